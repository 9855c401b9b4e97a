//! A member's side of a returner's catch-up (docs/fault-tolerance.md, "A return that does not
//! pause the survivors"): asking the coordinator for it, and, on the coordinator's process,
//! taking a returner's request for the training thread.

use std::time::{Duration, Instant};

use super::super::catch_up::{Catching, NoCatchUp, Offer, LARGEST_PART, NOTHING_TRAINS};
use super::super::wire::proto;
use super::ControlPlane;

/// Why a catch-up stream did not open.
enum Opening {
    /// The member could not be connected to.
    Unreached(String),
    /// It did not answer the request in time.
    Unanswered(String),
    /// It refused the request.
    Refused(String),
}

impl Opening {
    fn why(self) -> String {
        match self {
            Opening::Unreached(why) | Opening::Unanswered(why) | Opening::Refused(why) => why,
        }
    }
}

impl ControlPlane {
    /// A returner's request to catch up, left here while this process coordinates (its next
    /// step boundary takes the snapshot).
    pub(crate) fn catch_up_offer(&self) -> Option<Offer> {
        self.hub.catch_up.take()
    }

    /// A returner's request for the ranges of the optimizer state this member owns, if one waits
    /// (docs/fault-tolerance.md, "Ranges streamed"; its generation is the offer's).
    pub(crate) fn range_offer(&self) -> Option<Offer> {
        self.hub.ranges.take()
    }

    /// Asks member `donor` for the ranges this returner will hold that it owns in `generation`
    /// (docs/fault-tolerance.md, "Ranges streamed"): the stream, or why not. `patience` bounds the
    /// wait for each part.
    pub(crate) fn catch_up_ranges(
        &self,
        donor: usize,
        generation: u64,
        patience: Duration,
    ) -> Result<Catching, String> {
        let request = proto::CatchUpRequest {
            rank: self.rank as u32,
            incarnation: self.incarnation,
            generation,
            ..Default::default()
        };
        self.open((donor, true), request, (self.timeouts.heartbeat_deadline, patience)).map_err(Opening::why)
    }

    /// Asks the coordinator this member follows to catch up with the generation it trains
    /// (docs/fault-tolerance.md, "A return that does not pause the survivors"): the stream, once
    /// its first part is on its way, or why not (the caller joins as before). `patience` bounds
    /// the wait for each part.
    pub(crate) fn catch_up(&self, patience: Duration) -> Result<Catching, NoCatchUp> {
        let Some((term, rank, _)) = self.coordinator() else {
            return Err(NoCatchUp::NothingTrains("no coordinator is known".into()));
        };
        if rank == self.rank {
            return Err(NoCatchUp::NothingTrains("this process coordinates".into()));
        }
        let request = proto::CatchUpRequest {
            rank: self.rank as u32,
            incarnation: self.incarnation,
            cluster_json: self.identity.cluster_json.clone(),
            plugin_identity: self.identity.plugin.clone(),
            run_config_json: self.identity.run_config_json.clone(),
            term: self.shared.elections.vote().term.max(term),
            generation: 0,
        };
        // One attempt: a coordinator not up yet (a cluster starting) has nothing to catch up with.
        self.open((rank, false), request, (Duration::from_millis(1), patience)).map_err(|e| match e {
            Opening::Unreached(why) => NoCatchUp::NothingTrains(why),
            Opening::Refused(why) if why == NOTHING_TRAINS => NoCatchUp::NothingTrains(why),
            Opening::Refused(why) | Opening::Unanswered(why) => NoCatchUp::Refused(why),
        })
    }

    /// A catch-up stream from member `rank` (`ranges`: its `CatchUpRanges`, else `CatchUp`) for
    /// `request`, connecting for `connect` and answered within a heartbeat deadline; each part
    /// waited for `patience`.
    fn open(
        &self,
        (rank, ranges): (usize, bool),
        request: proto::CatchUpRequest,
        (connect, patience): (Duration, Duration),
    ) -> Result<Catching, Opening> {
        let (dial, deadline, name) = (&self.dials[rank], self.timeouts.heartbeat_deadline, &self.names[rank]);
        let stream = self.runtime.block_on(async {
            let client = dial.connect(Instant::now() + connect).await.map_err(|e| Opening::Unreached(e.to_string()))?;
            let mut client = client.max_decoding_message_size(LARGEST_PART);
            let answer = async {
                match ranges {
                    true => client.catch_up_ranges(request).await,
                    false => client.catch_up(request).await,
                }
            };
            let call = tokio::time::timeout(deadline, answer).await;
            let reply = call
                .map_err(|_| Opening::Unanswered(format!("{name} did not answer in {:.1}s", deadline.as_secs_f64())))?;
            reply.map(tonic::Response::into_inner).map_err(|status| Opening::Refused(status.message().to_string()))
        })?;
        Ok(Catching::new(stream, self.runtime.handle().clone(), patience))
    }

    /// Tells the coordinator this returner's replay reached `step`, and whether the streams of
    /// its ranges have not all begun (`pending`; sent in the background; one lost is made up for
    /// by the next).
    pub(crate) fn caught_up_to(&self, step: u64, pending: bool) {
        let Some((_, _, dial)) = self.coordinator() else { return };
        let request = proto::CatchUpProgressRequest { rank: self.rank as u32, step, ranges_pending: pending };
        let dial = dial.clone();
        self.runtime.spawn(async move {
            if let Ok(mut client) = dial.connect(Instant::now() + Duration::from_secs(1)).await {
                let _ = tokio::time::timeout(Duration::from_secs(1), client.catch_up_progress(request)).await;
            }
        });
    }
}
