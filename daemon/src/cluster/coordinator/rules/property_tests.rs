//! The coordinator's rules under random sequences of events: formations hold a majority and
//! generations grow, and the steps the formations count as lost or trained again are those a
//! model of the cluster counts step by step.

use super::tests::{report, AT_ONCE, ELASTIC};
use super::*;
use proptest::prelude::*;

/// One event in a cluster's life, for the property test.
#[derive(Clone, Debug)]
enum Event {
    /// A member's process dies (its stream closes).
    Lose(usize),
    /// A member freezes (its stream stays open, it stops beating), or wakes.
    Freeze(usize),
    /// A member's process starts (again) and joins with no state.
    Start(usize),
    /// Every live active member abandons its step and rejoins with its state.
    Rejoin,
    /// Time passes.
    Wait(u64),
}

fn event(world: usize) -> impl Strategy<Value = Event> {
    prop_oneof![
        (0..world).prop_map(Event::Lose),
        (0..world).prop_map(Event::Freeze),
        (0..world).prop_map(Event::Start),
        Just(Event::Rejoin),
        (1u64..30).prop_map(Event::Wait),
    ]
}

proptest! {
    /// Whatever the sequence of losses, freezes, returns and waits, going on at once or
    /// after `--replace-after`: every formation holds at least `min_workers` live members
    /// that joined, the chief among them, so the slots of `assign` are each held exactly
    /// once; generations only grow; a lone side never forms.
    #[test]
    fn formations_hold_a_majority_and_generations_grow(
        world in 2usize..6,
        at_once in proptest::bool::ANY,
        events in proptest::collection::vec(event(5), 1..40),
    ) {
        let opts = Options { min_workers: world / 2 + 1, ..if at_once { AT_ONCE } else { ELASTIC } };
        let (mut frozen, t0, mut incarnation, mut last_generation) = (vec![false; world], Instant::now(), 1, 0);
        let mut now = t0;
        let mut s = State::new(world, 0, t0);
        let names: Vec<String> = (0..world).map(|r| format!("worker {r}")).collect();
        for e in events {
            match e {
                Event::Lose(r) if r < world && r != 0 => {
                    s.members[r].connected = false;
                    s.members[r].lost = true;
                }
                Event::Freeze(r) if r < world && r != 0 => frozen[r] = !frozen[r],
                Event::Start(r) if r < world && r != 0 => {
                    incarnation += 1;
                    let m = &mut s.members[r];
                    if m.active {
                        m.gone = Some(Gone::Restarted);
                    }
                    *m = MemberState { incarnation: Some(incarnation), connected: true, lost: false, last_seen: now, joined: Some(report(0, 0, "")), ..m.clone() };
                    frozen[r] = false;
                }
                Event::Rejoin => {
                    let awake = s.members.iter_mut().zip(&frozen).filter(|(_, f)| !**f).map(|(m, _)| m);
                    for m in awake.filter(|m| m.connected && (m.active || m.joined.is_none())) {
                        m.joined = Some(report(s.generation, 1, "x"));
                    }
                }
                Event::Wait(secs) => now += Duration::from_secs(secs),
                _ => {}
            }
            // Live members that are not frozen beat.
            for (m, _) in s.members.iter_mut().zip(&frozen).filter(|(m, f)| m.connected && !**f) {
                m.last_seen = now;
            }
            s.last_tick = now;
            let mut rounds = 0;
            while let Some(d) = decide(&s, now, &opts) {
                if let Decision::Form(f) = &d {
                    prop_assert!(f.members.len() >= opts.min_workers, "{:?}", f.members);
                    prop_assert!(f.members.contains(&0));
                    prop_assert!(f.members.iter().all(|&r| s.members[r].connected && s.members[r].joined.is_some()));
                    prop_assert!(f.members.iter().all(|&r| !frozen[r] || now.saturating_duration_since(s.members[r].last_seen) <= opts.heartbeat_deadline), "a frozen member trains");
                    prop_assert!(f.generation > last_generation);
                    last_generation = f.generation;
                    let held: Vec<usize> = crate::collective::slots::assign(world, &f.members).into_iter().flatten().collect();
                    prop_assert_eq!(held, (0..world).collect::<Vec<_>>());
                }
                s.apply(d, now, &names);
                rounds += 1;
                prop_assert!(rounds < 10, "decisions settle");
            }
        }
    }
}

/// What happens to the cluster in the counts' model.
#[derive(Clone, Debug)]
enum Happening {
    /// The generation trains this many steps.
    Train(u64),
    /// A member dies inside a step: the members flagged complete it (the victim's completion
    /// reaches the coordinator only if a beat carried it).
    Kill { victim: usize, ahead: Vec<bool>, beaten: bool },
    /// A comparison finds a corrupted replica: every member goes back to the last compared
    /// step (a multiple of 10).
    Repair,
    /// A dead member's process starts again and comes back.
    Restart(usize),
    /// Two members die close together: the first inside a step that the members flagged
    /// complete (their beats too late to count); the second after its join, before the
    /// survivors can form; the first's new process then makes a majority, and reports what
    /// its predecessor recorded (the step it completed, if it was flagged: before position
    /// records, a step only the first had completed was not counted).
    TwoClose { first: usize, second: usize, ahead: Vec<bool> },
}

fn happening() -> impl Strategy<Value = Happening> {
    prop_oneof![
        3 => (1u64..25).prop_map(Happening::Train),
        2 => (1usize..4, proptest::collection::vec(any::<bool>(), 4), any::<bool>())
            .prop_map(|(victim, ahead, beaten)| Happening::Kill { victim, ahead, beaten }),
        1 => Just(Happening::Repair),
        2 => (1usize..4).prop_map(Happening::Restart),
        1 => (1usize..4, 1usize..4, proptest::collection::vec(any::<bool>(), 4))
            .prop_map(|(first, second, ahead)| Happening::TwoClose { first, second, ahead }),
    ]
}

/// A member of the model: its state's step (`None`: none), how far it reached since it
/// adopted a formation, whether it went back for a repair, its last generation and members.
#[derive(Clone, Debug, Default)]
struct Held {
    step: Option<u64>,
    reached: u64,
    repaired: bool,
    generation: u64,
    members: Vec<usize>,
    alive: bool,
    /// What the process before this one recorded (its generation and furthest step), until
    /// this one adopts a formation.
    recorded: Option<(u64, u64)>,
}

impl Held {
    fn report(&self) -> Report {
        let (generation, reached, repaired, members) =
            (self.generation, self.reached, self.repaired, self.members.clone());
        let recorded = self.recorded;
        match self.step {
            Some(step) => {
                let digest = format!("s{step}");
                let progress = (step, 0);
                Report { generation, progress, digest, reached, repaired, members, recorded, ..Report::default() }
            }
            None => Report { generation, reached, repaired, members, recorded, ..Report::default() },
        }
    }

    /// A new process for this rank: nothing held but what the dead one recorded.
    fn restarted(&self) -> Held {
        Held { alive: true, recorded: self.recorded, ..Held::default() }
    }
}

/// A cluster of 4 (a majority of 3 needed; the coordinator's rank 0 is never lost) whose steps
/// are counted twice: as the formations count them, and as trained, step by step.
struct Model {
    s: State,
    held: Vec<Held>,
    t0: Instant,
    incarnation: u64,
    /// Every formation's (steps trained again, steps lost), summed.
    counted: (u64, u64),
    /// The furthest step trained, the steps trained again since, and the steps the repairs
    /// sent the members back over.
    trained: u64,
    retrained: u64,
    repairs: u64,
}

impl Model {
    const OPTS: Options = Options { min_workers: 3, ..AT_ONCE };

    fn new() -> Model {
        let t0 = Instant::now();
        let held = vec![Held { step: Some(0), alive: true, ..Held::default() }; 4];
        let mut m = Model {
            s: State::new(4, 0, t0),
            held,
            t0,
            incarnation: 0,
            counted: (0, 0),
            trained: 0,
            retrained: 0,
            repairs: 0,
        };
        for r in 0..4 {
            m.start(r);
        }
        m.settle();
        m
    }

    fn active(&self) -> Vec<usize> {
        (0..4).filter(|&r| self.s.members[r].active).collect()
    }

    /// Rank `r`'s process claims its rank and joins.
    fn start(&mut self, r: usize) {
        self.incarnation += 1;
        let m = &mut self.s.members[r];
        (m.incarnation, m.connected, m.lost, m.last_seen) = (Some(self.incarnation), true, false, self.t0);
        self.join(r);
    }

    fn join(&mut self, r: usize) {
        let report = self.held[r].report();
        self.s.joined(&report);
        self.s.members[r].joined = Some(report);
    }

    /// The decisions until none is due; each formation adopted by its members, and counted.
    fn settle(&mut self) {
        while let Some(d) = decide(&self.s, self.t0, &Self::OPTS) {
            if let Decision::Form(f) = &d {
                self.counted.0 += f.steps_trained_again;
                self.counted.1 += f.steps_lost;
                for &r in &f.members {
                    let h = &mut self.held[r];
                    (h.step, h.reached, h.repaired) = (Some(f.progress.0), f.progress.0, false);
                    (h.generation, h.members, h.recorded) = (f.generation, f.members.clone(), None);
                }
            }
            self.s.apply(d, self.t0, &names4());
        }
    }

    /// Step `n` completed by `ranks` (their beats carry it when `beaten`).
    fn complete(&mut self, n: u64, ranks: &[usize], beaten: bool) {
        if ranks.is_empty() {
            return;
        }
        if n <= self.trained {
            self.retrained += 1;
        }
        self.trained = self.trained.max(n);
        for &r in ranks {
            let h = &mut self.held[r];
            (h.step, h.reached) = (Some(n), h.reached.max(n));
            if beaten {
                self.s.heard(h.generation, n);
            }
        }
    }

    fn step_of(&self) -> u64 {
        self.held[0].step.expect("the coordinator's member holds a state")
    }

    /// Rank `r`'s process dies: the coordinator sees its stream close.
    fn die(&mut self, r: usize) {
        let h = &self.held[r];
        let recorded = (h.generation > 0).then_some((h.generation, h.reached));
        self.held[r] = Held { recorded, ..Held::default() };
        (self.s.members[r].connected, self.s.members[r].lost) = (false, true);
        self.settle();
    }

    /// The members end the generation with their states and rejoin (a return's boundary, a
    /// repair), and the next one forms.
    fn rejoin(&mut self) {
        let alive: Vec<usize> = (0..4).filter(|&r| self.held[r].alive).collect();
        for r in alive {
            self.join(r);
        }
        self.settle();
    }

    fn happen(&mut self, h: Happening) {
        match h {
            Happening::Train(k) => {
                for _ in 0..k {
                    let (n, ranks) = (self.step_of() + 1, self.active());
                    self.complete(n, &ranks, true);
                }
            }
            Happening::Kill { victim, ahead, beaten } if self.active().len() == 4 => {
                let n = self.step_of() + 1;
                let survivors: Vec<usize> = (0..4).filter(|&r| r != victim && ahead[r]).collect();
                // Step n exists as far as positions tell: a survivor holds it, or the victim's
                // beat carried it before it died.
                match survivors.is_empty() {
                    false => self.complete(n, &survivors, true),
                    true if ahead[victim] && beaten => self.complete(n, &[victim], true),
                    true => {}
                }
                self.die(victim);
                self.rejoin();
            }
            Happening::TwoClose { first, second, ahead } if first != second && self.active().len() == 4 => {
                let n = self.step_of() + 1;
                // The first's completion is known from its record once its new process joins.
                let done: Vec<usize> = (0..4).filter(|&r| ahead[r]).collect();
                self.complete(n, &done, false);
                self.die(first);
                self.join(second);
                self.die(second);
                self.rejoin();
                assert!(self.active().is_empty(), "2 of 4 form nothing");
                self.held[first] = self.held[first].restarted();
                self.start(first);
                self.settle();
            }
            Happening::Repair => {
                let to = self.step_of() / 10 * 10;
                self.repairs += self.step_of() - to;
                for r in self.active() {
                    (self.held[r].step, self.held[r].repaired) = (Some(to), true);
                }
                self.rejoin();
            }
            Happening::Restart(r) if !self.held[r].alive => {
                self.held[r] = self.held[r].restarted();
                self.start(r);
                self.settle();
                assert_eq!(returners(&self.s, self.t0, &Self::OPTS), vec![r], "a return waits for a boundary");
                let (n, ranks) = (self.step_of() + 1, self.active());
                self.complete(n, &ranks, true);
                self.rejoin();
            }
            _ => {}
        }
    }
}

fn names4() -> Vec<String> {
    (0..4).map(|r| format!("worker {r}")).collect()
}

proptest! {
    /// Whatever the sequence of steps, kills (the survivors a step apart, the victim ahead of
    /// them or not), repairs of a corrupted replica and returns: summed over the formations,
    /// the steps trained again are exactly the steps trained a second time or more, and the
    /// steps trained again but not lost are exactly those the repairs went back over.
    #[test]
    fn formation_counts_equal_what_the_positions_show(happenings in proptest::collection::vec(happening(), 1..30)) {
        let mut m = Model::new();
        for h in happenings {
            m.happen(h);
            prop_assert_eq!(m.active(), (0..4).filter(|&r| m.held[r].alive).collect::<Vec<_>>());
        }
        // Train on past every step reached: every step owed is trained again.
        let owed = m.trained + 1 - m.step_of();
        m.happen(Happening::Train(owed));
        prop_assert_eq!(m.counted.0, m.retrained, "steps trained again");
        prop_assert_eq!(m.counted.0 - m.counted.1, m.repairs, "steps trained again for a repair");
    }
}
