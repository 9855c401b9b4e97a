//! A member's side of the control plane. The [`ControlPlane`] ([`control_plane`]) holds the
//! server every daemon runs (with the coordinator on the coordinator's process), the heartbeat
//! stream to the coordinator ([`heartbeat`]), and the blocking calls the training thread makes:
//! [`ControlPlane::join`] (the next generation), [`ControlPlane::barrier`],
//! [`ControlPlane::abandon`] (a failure seen here: abort the generation and push the notice to
//! every peer) and [`ControlPlane::leave`].
//!
//! The member's decisions are pure functions ([`watch`]): when the chief counts as lost (the
//! heartbeat stream breaks because the chief died, or its acks stop because it froze: the member
//! then aborts its generation and tells every peer, so nobody waits for a timeout), and when a
//! join stops waiting. The chief's answers are read one way for every call
//! ([`super::error::from_status`]); [`dial`] is how a member reaches the others.

mod catch_up;
mod control_plane;
pub(crate) mod dial;
mod elect;
mod finished;
mod formed;
mod found;
pub(crate) mod heartbeat;
pub(crate) mod parts;
mod position;
mod setup;
pub(crate) mod watch;

use super::error::ClusterError;
use super::service::Chair;
use control_plane::Shared;
pub(crate) use control_plane::{ControlPlane, FinishedProbe, Settings};
pub(crate) use dial::resolve;
use dial::Dial;

#[cfg(test)]
mod tests;
