//! The elector task: while this member's coordinator is lost (or while this process coordinates
//! and gathers), it asks the others whom they follow and follows the highest term it hears of;
//! once the coordinator has been lost for longer than `--replace-after` (staggered by rank), it
//! stands: votes from a majority of the run's ranks make it the coordinator of a new term. The
//! rules are [`super::super::election`]'s; this task asks, persists and carries them out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tonic::transport::Channel;

use super::super::coordinator::{Coordinator, Seat};
use super::super::election::{caught_up, next_term, stands, won};
use super::super::service::{depose, seated, Chair};
use super::super::timeouts::Timeouts;
use super::super::wire::{proto, ControlClient, Identity};
use super::Shared;

/// What the elector needs.
pub(super) struct Elector {
    pub(super) rank: usize,
    pub(super) names: Arc<Vec<String>>,
    pub(super) peers: Arc<Vec<Option<ControlClient<Channel>>>>,
    pub(super) shared: Arc<Shared>,
    pub(super) chair: Chair,
    pub(super) identity: Identity,
    pub(super) timeouts: Timeouts,
}

impl Elector {
    /// Looks now and then (more often while the coordinator is lost), until a newer process
    /// takes this rank.
    pub(super) async fn run(self) {
        let elections = Arc::clone(&self.shared.elections);
        let world = self.names.len();
        let mut tries = 0u32;
        // The coordinator followed before it was lost, and the term this process coordinated.
        let mut followed = elections.coordinator().map(|(_, r)| r);
        let mut coordinated = seated(&self.chair).map(|c| c.term());
        let mut busy = false;
        // Pre-votes that found no majority in a row: the first few are tried again soon (a voter
        // that has not seen the loss yet sees it within milliseconds).
        let mut unripe = 0u32;
        loop {
            let pause =
                if (1..=5).contains(&unripe) { self.timeouts.heartbeat_interval / 10 } else { self.pause(busy) };
            let _ = tokio::time::timeout(pause, elections.look_now()).await;
            if self.shared.replaced().is_some() {
                return;
            }
            let here = seated(&self.chair);
            if let Some(c) = &here {
                coordinated = Some(c.term());
            }
            let gathering = here.as_ref().is_some_and(|c| c.gathering());
            let asking = gathering || (elections.enabled() && elections.forgetful());
            busy = elections.lost_for(Instant::now()).is_some() || elections.coordinator().is_none();
            if !busy && !asking {
                (tries, unripe) = (0, 0);
                if let Some((_, r)) = elections.coordinator() {
                    followed = Some(r);
                }
                continue;
            }
            self.ask_who(&mut coordinated).await;
            let Some(lost_for) = elections.lost_for(Instant::now()) else { continue };
            // Only a member that has trained holds a state worth coordinating from, and only one
            // that keeps its vote may stand.
            let unsure = elections.generation() == 0 || elections.forgetful();
            if !elections.enabled() || unsure || seated(&self.chair).is_some() {
                continue;
            }
            let place = (0..world).filter(|&r| Some(r) != followed).position(|r| r == self.rank).unwrap_or(0);
            let opts = (self.timeouts.replace_after, self.timeouts.heartbeat_deadline);
            if !stands(lost_for, place, tries, world, opts) {
                continue;
            }
            // A pre-vote that fails (a voter has not seen the loss yet, or this member is cut
            // off) raises no term and costs no turn: it is tried again at the next look.
            match self.stand(followed, lost_for).await {
                Some(true) => {
                    (tries, unripe) = (0, 0);
                    coordinated = seated(&self.chair).map(|c| c.term());
                }
                Some(false) => (tries, unripe) = (tries + 1, 0),
                None => unripe += 1,
            }
        }
    }

    /// How long to wait before looking again (a coordinator newly lost, or a vote given, wakes
    /// it at once): every heartbeat interval while something is to be found out (`busy`: a lost
    /// coordinator, a winner not known yet), ten times as often after a vote given in an election
    /// whose winner is not known yet, else every third of a heartbeat deadline.
    fn pause(&self, busy: bool) -> Duration {
        let (t, elections) = (&self.timeouts, &self.shared.elections);
        let voted = elections.coordinator().is_none() && elections.vote().voted_for.is_some();
        match (busy, voted) {
            (true, true) => t.heartbeat_interval / 10,
            (true, false) => t.heartbeat_interval,
            (false, _) => t.heartbeat_deadline / 3,
        }
    }

    /// Asks every peer whom it follows, and follows the highest term heard of; a coordinator here
    /// of an older term is deposed, saying so.
    async fn ask_who(&self, coordinated: &mut Option<u64>) {
        // A majority's answers tell the highest term won (every one was kept by a majority): its
        // own counts, unless it lost its kept vote; a frozen peer's answer is not waited for.
        let world = self.names.len();
        let own = usize::from(!self.shared.elections.forgetful());
        let enough = move |answers: &[(usize, Result<tonic::Response<proto::WhoReply>, tonic::Status>)]| {
            caught_up(own + answers.iter().filter(|(_, a)| a.is_ok()).count(), world)
        };
        let quick = self.timeouts.heartbeat_deadline / 5;
        let answers = self.ask(|mut client| async move { client.who(proto::Empty {}).await }, (enough, quick)).await;
        let elections = &self.shared.elections;
        let mut best: Option<(u64, usize)> = None;
        let (mut heard, mut highest) = (0, 0);
        for (_, reply) in answers {
            let Ok(reply) = reply else { continue };
            let reply = reply.into_inner();
            (heard, highest) = (heard + 1, highest.max(reply.term));
            let coordinator = reply.coordinator as usize;
            if reply.known && coordinator < self.names.len() && coordinator != self.rank {
                best = best.max(Some((reply.term, coordinator)));
            }
        }
        // A member without its kept vote may vote again once a majority told it the term.
        if let Err(e) = elections.heard_from(heard, self.names.len(), highest) {
            tracing::error!("cannot keep the vote: {e}");
        }
        let Some((term, coordinator)) = best else { return };
        match elections.adopt(term, coordinator) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::error!("cannot keep the vote: {e}");
                return;
            }
        }
        let (me, them) = (&self.names[self.rank], &self.names[coordinator]);
        tracing::info!("{me}: following {them} (term {term})");
        if let Some(old) = coordinated.take() {
            let why = format!("{me}: {them} coordinates (term {term}); joining as a member");
            if let Some(c) = seated(&self.chair).filter(|c| c.term() < term) {
                depose(&self.chair, &c, &why);
            }
            eprintln!("trainerd: {why} (this worker coordinated term {old})");
        }
    }

    /// Stands in the next term; whether it won (`None`: its pre-vote found no majority, so it did
    /// not stand).
    async fn stand(&self, followed: Option<usize>, lost_for: Duration) -> Option<bool> {
        let elections = &self.shared.elections;
        let world = self.names.len();
        let me = &self.names[self.rank];
        let term = next_term(&elections.vote(), elections.generation());
        // A pre-vote first: a member that cannot win (cut off alone) raises no term.
        let (voters, refusals) = self.ballot(term, true).await;
        if !won(voters.len(), world) {
            tracing::info!("{me} would not win term {term}: {} of {world} ({})", voters.len(), refusals.join("; "));
            return None;
        }
        match elections.stand(term, self.rank) {
            Ok(true) => {}
            Ok(false) => return Some(false),
            Err(e) => {
                tracing::error!("cannot keep the vote: {e}");
                return Some(false);
            }
        }
        let lost = followed.map_or_else(|| "no coordinator".to_string(), |r| self.names[r].clone());
        tracing::info!("{me} stands in term {term}: {lost} lost for {:.1}s", lost_for.as_secs_f64());
        let (voters, refusals) = self.ballot(term, false).await;
        if !won(voters.len(), world) {
            tracing::warn!("{me} stood in term {term}: {} of {world} votes ({})", voters.len(), refusals.join("; "));
            return Some(false);
        }
        if !matches!(elections.adopt(term, self.rank), Ok(true)) {
            return Some(false);
        }
        let since = Instant::now() - lost_for;
        let seat =
            Seat { rank: self.rank, term, lost: followed.map(|r| (r, since)).into_iter().collect(), ever_formed: true };
        let c = Coordinator::new(self.identity.clone(), self.names.to_vec(), self.timeouts.options(world), seat);
        c.set_floor(self.shared.floor.load(std::sync::atomic::Ordering::Relaxed));
        *self.chair.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::clone(&c));
        elections.seated();
        tokio::spawn(Arc::clone(&c).tick(self.timeouts.heartbeat_interval / 4));
        let named: Vec<&str> = voters.iter().map(|&r| self.names[r].as_str()).collect();
        eprintln!(
            "trainerd: {me} coordinates from term {term}, elected by {} of {world} ({}); {lost} was lost for {:.1}s",
            voters.len(),
            named.join(", "),
            lost_for.as_secs_f64()
        );
        Some(true)
    }

    /// Asks every peer for its vote (or pre-vote) in `term`: the ranks that granted it (this one
    /// included), and why the others did not. A refusal that names a higher term or generation
    /// is remembered (the next try stands above it).
    async fn ballot(&self, term: u64, pre: bool) -> (Vec<usize>, Vec<String>) {
        let elections = &self.shared.elections;
        let request = proto::VoteRequest { term, candidate: self.rank as u32, pre };
        // Done once a majority granted (a dead or frozen peer's answer is not waited for).
        let world = self.names.len();
        let enough = move |answers: &[(usize, Result<tonic::Response<proto::VoteReply>, tonic::Status>)]| {
            won(1 + answers.iter().filter(|(_, a)| a.as_ref().is_ok_and(|r| r.get_ref().granted)).count(), world)
        };
        // A pre-vote changes nothing and answers at once: a peer that does not answer within a
        // fifth of a heartbeat deadline (frozen) is not waited for; a vote is kept on disk first.
        let wait = if pre { self.timeouts.heartbeat_deadline / 5 } else { self.timeouts.heartbeat_deadline };
        let answers = self.ask(move |mut client| async move { client.vote(request).await }, (enough, wait)).await;
        let mut voters = vec![self.rank];
        let mut refusals = Vec::new();
        for (rank, reply) in answers {
            match reply.map(tonic::Response::into_inner) {
                Ok(r) if r.granted => voters.push(rank),
                Ok(r) => {
                    let _ = elections.heard(r.term);
                    elections.saw(r.generation);
                    refusals.push(format!("{}: {}", self.names[rank], r.reason));
                }
                Err(status) => refusals.push(format!("{}: {}", self.names[rank], status.message())),
            }
        }
        voters.sort_unstable();
        (voters, refusals)
    }

    /// Calls every peer at once, each bounded by `deadline`, until every one answered
    /// or the answers so far are `enough`; the answers, by rank.
    async fn ask<F, Fut, T>(
        &self,
        call: F,
        (enough, deadline): (impl Fn(&[(usize, Result<T, tonic::Status>)]) -> bool, Duration),
    ) -> Vec<(usize, Result<T, tonic::Status>)>
    where
        F: Fn(ControlClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>> + Send + 'static,
        T: Send + 'static,
    {
        let mut calls = JoinSet::new();
        for (rank, client) in self.peers.iter().enumerate() {
            let Some(client) = client.clone() else { continue };
            let fut = call(client);
            calls.spawn(async move {
                let answer = tokio::time::timeout(deadline, fut).await;
                (rank, answer.unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer"))))
            });
        }
        let mut answers = Vec::new();
        while let Some(done) = calls.join_next().await {
            if let Ok(a) = done {
                answers.push(a);
                if enough(&answers) {
                    break;
                }
            }
        }
        answers.sort_by_key(|(rank, _)| *rank);
        answers
    }
}
