//! The gRPC service every daemon serves on its TF_CONFIG address: the coordinator's calls
//! (joins, heartbeats, reports, departures, barriers) when this process coordinates, the pushed
//! abort notices from its peers, and the election's calls (`Vote`, `Who`) that every member
//! answers. A caller that knows a newer term than the coordinator here deposes it.

use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::catch_up::{Hubs, PartStream};
use super::coordinator::Coordinator;
use super::election::{Ballot, Elections};
use super::finding::{Finding, Findings};
use super::parts::Reports;
use super::wire::{check_rank, proto};
use crate::collective::AbortSignal;
use proto::control_server::Control;

/// Where this process's coordinator sits when it coordinates: the chief's from the start, an
/// elected one's from its election, empty once deposed.
pub(crate) type Chair = Arc<RwLock<Option<Arc<Coordinator>>>>;

/// The coordinator in `chair`, if any.
pub(crate) fn seated(chair: &Chair) -> Option<Arc<Coordinator>> {
    chair.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
}

/// The service every daemon serves.
pub(crate) struct Service {
    /// This member's rank.
    pub(crate) rank: usize,
    /// Every member's name.
    pub(crate) names: Vec<String>,
    /// The coordinator, when this process coordinates.
    pub(crate) chair: Chair,
    /// This member's vote and what it knows of the coordinator.
    pub(crate) elections: Arc<Elections>,
    /// This member's collectives, for pushed aborts.
    pub(crate) abort: AbortSignal,
    /// Where a returner's request to catch up, or for the ranges this member owns, waits for this
    /// process's training thread.
    pub(crate) hub: Arc<Hubs>,
    /// What peers found at comparisons of the replicas, for this process's training thread.
    pub(crate) findings: Arc<Findings>,
    /// What members said of their parts of sharded commits, for this process's training thread.
    pub(crate) parts: Arc<Reports>,
}

impl Service {
    /// The coordinator here, for a caller that knows `term`: a caller that knows a newer term
    /// deposes it.
    fn coordinator(&self, term: u64) -> Result<Arc<Coordinator>, Status> {
        let Some(c) = seated(&self.chair) else {
            let follows = match self.elections.coordinator() {
                Some((t, r)) => format!("; it follows {} (term {t})", self.names[r]),
                None => String::new(),
            };
            return Err(Status::unavailable(format!("{} does not coordinate{follows}", self.names[self.rank])));
        };
        if term > c.term() {
            let why = format!(
                "{} no longer coordinates (term {}): a member knows term {term}",
                self.names[self.rank],
                c.term()
            );
            depose(&self.chair, &c, &why);
            let _ = self.elections.heard(term);
            return Err(Status::unavailable(why));
        }
        Ok(c)
    }
}

/// Takes `c` out of `chair` (if it still sits there) and deposes it.
pub(crate) fn depose(chair: &Chair, c: &Arc<Coordinator>, why: &str) {
    let mut seat = chair.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    if seat.as_ref().is_some_and(|s| Arc::ptr_eq(s, c)) {
        *seat = None;
    }
    drop(seat);
    c.depose(why);
}

type NoticeStream = Pin<Box<dyn Stream<Item = Result<proto::Notice, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Control for Service {
    async fn join(&self, request: Request<proto::JoinRequest>) -> Result<Response<proto::JoinReply>, Status> {
        let request = request.into_inner();
        let c = self.coordinator(request.term)?;
        c.join(request).await.map(Response::new)
    }

    type HeartbeatStream = NoticeStream;

    async fn heartbeat(&self, request: Request<Streaming<proto::Beat>>) -> Result<Response<NoticeStream>, Status> {
        let c = self.coordinator(0)?;
        let mut inbound = request.into_inner();
        let (sink, notices) = mpsc::unbounded_channel();
        let (chair, elections, me) =
            (Arc::clone(&self.chair), Arc::clone(&self.elections), self.names[self.rank].clone());
        tokio::spawn(async move {
            let mut registered = None;
            while let Ok(Some(beat)) = inbound.message().await {
                if beat.term > c.term() {
                    let why =
                        format!("{me} no longer coordinates (term {}): a member knows term {}", c.term(), beat.term);
                    depose(&chair, &c, &why);
                    let _ = elections.heard(beat.term);
                    break;
                }
                if !c.beat(&beat, &sink, &mut registered) {
                    break;
                }
            }
            if let Some((rank, incarnation)) = registered {
                c.disconnected(rank, incarnation);
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(notices))))
    }

    async fn report(&self, request: Request<proto::ReportRequest>) -> Result<Response<proto::Empty>, Status> {
        self.coordinator(0)?.report(request.into_inner()).map(|()| Response::new(proto::Empty {}))
    }

    async fn leave(&self, request: Request<proto::LeaveRequest>) -> Result<Response<proto::Empty>, Status> {
        self.coordinator(0)?.leave(request.into_inner()).map(|()| Response::new(proto::Empty {}))
    }

    async fn barrier(&self, request: Request<proto::BarrierRequest>) -> Result<Response<proto::Empty>, Status> {
        let c = self.coordinator(0)?;
        c.barrier(request.into_inner()).await.map(|()| Response::new(proto::Empty {}))
    }

    async fn abort(&self, request: Request<proto::AbortRequest>) -> Result<Response<proto::Empty>, Status> {
        let req = request.into_inner();
        let from = check_rank(req.rank, self.names.len())?;
        let reason: String = req.reason.chars().take(300).collect();
        if self.abort.trigger(req.generation, &format!("{}: {reason}", self.names[from])) {
            tracing::info!("generation {} aborted by {}: {reason}", req.generation, self.names[from]);
        }
        Ok(Response::new(proto::Empty {}))
    }

    async fn found(&self, request: Request<proto::FoundRequest>) -> Result<Response<proto::Empty>, Status> {
        let req = request.into_inner();
        let from = check_rank(req.rank, self.names.len())?;
        let (odd, why): (Vec<String>, String) = (req.odd.into_iter().take(self.names.len()).collect(), req.why);
        let why: String = why.chars().take(2000).collect();
        tracing::info!("{} found at step {} of generation {}: {why}", self.names[from], req.step, req.generation);
        let finder = self.names[from].clone();
        let (generation, step, in_place) = (req.generation, req.step, req.in_place);
        self.findings.keep(Finding { generation, finder, step, odd, why, in_place });
        Ok(Response::new(proto::Empty {}))
    }

    async fn parts(&self, request: Request<proto::PartsRequest>) -> Result<Response<proto::Empty>, Status> {
        let req = request.into_inner();
        let from = check_rank(req.rank, self.names.len())?;
        let said = if req.error.is_empty() { Ok(req.entries_json) } else { Err(req.error) };
        tracing::debug!(
            "{} said of its parts of {} (generation {}): {}",
            self.names[from],
            req.data_id,
            req.generation,
            said.is_ok()
        );
        self.parts.keep((req.generation, &req.data_id), from, said);
        Ok(Response::new(proto::Empty {}))
    }

    async fn vote(&self, request: Request<proto::VoteRequest>) -> Result<Response<proto::VoteReply>, Status> {
        let req = request.into_inner();
        let candidate = check_rank(req.candidate, self.names.len())?;
        let ballot = Ballot { term: req.term, candidate };
        let reply = match self.elections.answer(&ballot, Instant::now(), req.pre) {
            Ok(()) => {
                if !req.pre {
                    tracing::info!("voted for {} in term {}", self.names[candidate], req.term);
                }
                proto::VoteReply { granted: true, term: req.term, generation: 0, reason: String::new() }
            }
            Err((refusal, vote, generation)) => {
                let coordinator = vote.coordinator.map(|r| self.names[r].as_str());
                let reason = if self.elections.enabled() {
                    refusal.reason(coordinator)
                } else {
                    "it keeps no vote (--no-failover)".to_string()
                };
                proto::VoteReply { granted: false, term: vote.term, generation, reason }
            }
        };
        Ok(Response::new(reply))
    }

    type CatchUpStream = PartStream;

    async fn catch_up(&self, request: Request<proto::CatchUpRequest>) -> Result<Response<PartStream>, Status> {
        let req = request.into_inner();
        let c = self.coordinator(req.term)?;
        let (rank, name, generation) = c.may_catch_up(&req)?;
        let stream = self.hub.catch_up.offer(rank, &name, generation)?;
        // As a return without a catch-up says it ends the generation (coordinator's `join`).
        eprintln!("trainerd: {name} came back; it catches up with generation {generation} while the others train");
        Ok(Response::new(stream))
    }

    type CatchUpRangesStream = PartStream;

    async fn catch_up_ranges(&self, request: Request<proto::CatchUpRequest>) -> Result<Response<PartStream>, Status> {
        let req = request.into_inner();
        let rank = req.rank as usize;
        let Some(name) = self.names.get(rank).filter(|_| rank != self.rank) else {
            return Err(Status::invalid_argument(format!(
                "rank {rank} cannot ask {} for ranges",
                self.names[self.rank]
            )));
        };
        // The generation is checked where the training thread takes the request.
        let stream = self.hub.ranges.offer(rank, name, req.generation)?;
        tracing::info!("{name} asks for the ranges it will hold");
        Ok(Response::new(stream))
    }

    async fn catch_up_progress(
        &self,
        request: Request<proto::CatchUpProgressRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let req = request.into_inner();
        if !self.hub.catch_up.progress(req.rank as usize, req.step, req.ranges_pending) {
            return Err(Status::failed_precondition(format!("no catch-up of rank {} is running here", req.rank)));
        }
        Ok(Response::new(proto::Empty {}))
    }

    async fn who(&self, _: Request<proto::Empty>) -> Result<Response<proto::WhoReply>, Status> {
        let vote = self.elections.vote();
        Ok(Response::new(proto::WhoReply {
            term: vote.term,
            known: vote.coordinator.is_some(),
            coordinator: vote.coordinator.unwrap_or(0) as u32,
        }))
    }
}
