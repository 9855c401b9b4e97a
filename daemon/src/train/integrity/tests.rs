use super::*;

#[test]
fn equal_digests_have_no_verdict() {
    assert_eq!(verdict(&[7, 7, 7], 0), None);
}

#[test]
fn the_majority_is_right_even_against_the_coordinator() {
    assert_eq!(verdict(&[1, 2, 2], 0), Some(Verdict { right: 2, odd: vec![0] }));
    assert_eq!(verdict(&[2, 1, 2, 2], 3), Some(Verdict { right: 2, odd: vec![1] }));
    // Two odd ones, each their own way.
    assert_eq!(verdict(&[3, 2, 2, 2, 4], 0), Some(Verdict { right: 2, odd: vec![0, 4] }));
}

#[test]
fn without_a_majority_the_coordinator_is_right() {
    assert_eq!(verdict(&[1, 2], 0), Some(Verdict { right: 1, odd: vec![1] }));
    assert_eq!(verdict(&[1, 2], 1), Some(Verdict { right: 2, odd: vec![0] }));
    assert_eq!(verdict(&[1, 1, 2, 2], 2), Some(Verdict { right: 2, odd: vec![0, 1] }));
}

/// Found by the kernels' chaos test: two workers whose initial states differed at step 0
/// both dropped them (nothing agreed yet), and every formation after it at step 0 was taken
/// for one past the mismatch, sending everyone back again, for ever. Only a member that went
/// back to an earlier step flags a formation at or past the mismatch.
#[test]
fn a_formation_past_a_mismatch_is_flagged_only_where_the_run_went_back_before_it() {
    let mut integrity = Integrity::new(Schedule { every: 25, commits: 40 });
    integrity.went_back(0, None);
    assert_eq!(integrity.flags(0, true), Flags::default());
    integrity.went_back(40, Some(40));
    assert_eq!(integrity.flags(40, true), Flags::default());
    integrity.went_back(40, Some(25));
    assert_eq!(integrity.flags(40, true), Flags { mismatch: true, owes: false });
    assert_eq!(integrity.flags(41, true), Flags { mismatch: true, owes: false });
    assert_eq!(integrity.flags(25, true), Flags::default(), "the repair's own formation");
    assert_eq!(integrity.flags(40, false), Flags::default(), "a formation where no member held a state");
}

/// The suite's failure at 65fe391: the drifted worker's comparison alone completed, and it
/// dropped its state. Its finding still sends the run back: the state it dropped was trained
/// since the members last agreed (step 25), so a formation at step 40 is flagged, by it and by
/// every peer it told. A mismatch found where the members last held the same state (a
/// formation's, with no step since) condemns nothing but the odd replicas.
#[test]
fn a_finder_that_dropped_its_state_still_flags_the_formation_past_its_finding() {
    let mut finder = Integrity::new(Schedule { every: 25, commits: 40 });
    finder.equal_at = 25;
    finder.went_back(40, None);
    assert_eq!(finder.flags(40, true), Flags { mismatch: true, owes: false });
    let mut at_formation = Integrity::new(Schedule { every: 25, commits: 40 });
    at_formation.equal_at = 30;
    at_formation.went_back(30, None);
    assert_eq!(at_formation.flags(30, true), Flags::default());

    let mut told = Integrity::new(Schedule { every: 25, commits: 40 });
    told.owed = Some(40);
    let finding = |step: u64| Finding {
        generation: 2,
        finder: "worker 2".into(),
        step,
        odd: vec!["worker 2".into()],
        why: format!("replica check at step {step}"),
        in_place: false,
    };
    let heard = told.heard(vec![finding(50), finding(40)], (&mut state_at(40), "worker 0"));
    assert_eq!(heard, vec![], "nothing said until the formation goes back");
    assert_eq!(told.flags(40, true), Flags { mismatch: true, owes: true });
    assert_eq!(told.heard.as_ref().map(|f| f.step), Some(40), "the earliest finding is said");
}

/// Found by the sharded chaos test in CI: the drifted worker and worker 3 completed the
/// per-step check and repaired it in place; the chief's exchange was cut short, and its
/// summary named no mismatch.
#[test]
fn a_finding_repaired_in_place_is_counted_once_and_sends_nobody_back() {
    let mut told = Integrity::new(Schedule { every: 10, commits: 25 });
    let finding = Finding {
        generation: 1,
        finder: "worker 3".into(),
        step: 27,
        odd: vec!["worker 2".into()],
        why: "replica check at step 28, before its update".into(),
        in_place: true,
    };
    let mut state = state_at(27);
    let said = told.heard(vec![finding.clone(), finding.clone()], (&mut state, "worker 0"));
    let line = "trainerd: worker 3 found: replica check at step 28, before its update; no step is lost";
    assert_eq!(said, vec![(line.to_string(), vec!["worker 2".to_string()])]);
    assert!(state.live(), "worker 0 is not named: it keeps its state");
    assert_eq!(told.flags(27, true), Flags::default());
    assert_eq!(told.figures().mismatches.len(), 1);
    // Heard again in a later formation (told twice), or found by this member itself: once.
    assert_eq!(told.heard(vec![finding.clone()], (&mut state, "worker 0")), vec![]);
    assert_eq!(told.figures().mismatches.len(), 1);
    // The odd member whose own exchange was cut short drops its parameters, as the finder
    // did it; at another step (a state it no longer holds), it keeps what it has.
    let mut odd = Integrity::new(Schedule { every: 10, commits: 25 });
    let mut elsewhere = state_at(30);
    let said = odd.heard(vec![finding.clone()], (&mut elsewhere, "worker 2"));
    assert!(elsewhere.live() && said[0].0.ends_with("; no step is lost"), "{said:?}");
    let (mut odd, mut state) = (Integrity::new(Schedule { every: 10, commits: 25 }), state_at(27));
    let said = odd.heard(vec![finding], (&mut state, "worker 2"));
    assert!(!state.live() && said[0].0.ends_with(DROPS_PARAMETERS), "{said:?}");
}

/// A live state of one parameter at global step `step`.
fn state_at(step: u64) -> TrainState {
    let params = vec![("w".to_string(), tch::Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu)))];
    let optimizer = crate::train::Optimizer::new(trainerd_sdk::OptimizerConfig::sgd(0.1), &params);
    let mut model = crate::state::ModelState::new((params, Vec::new()), 1, tch::Device::Cpu, true);
    model.position.global_step = step;
    TrainState::new(model, optimizer)
}

#[test]
fn checks_fall_on_the_interval_and_on_commits_but_not_on_an_epochs_last_step() {
    let at = |global_step, step_in_epoch| Position { global_step, step_in_epoch, ..Position::start(1) };
    // Every 100 steps, and on the commits of one member every 30 and another every 45.
    let commits = [30, 45];
    assert!(due(100, &commits, &at(100, 10), 50));
    assert!(due(100, &commits, &at(30, 30), 50));
    assert!(due(100, &commits, &at(45, 45), 50));
    assert!(!due(100, &commits, &at(31, 31), 50));
    assert!(!due(100, &commits, &at(300, 50), 50), "checked at the epoch's end instead");
    assert!(!due(0, &[], &at(100, 1), 50));
}
