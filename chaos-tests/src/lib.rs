//! Tests that kill trainerd workers mid-training and check what survives: `tests/kill.rs` (one
//! worker, and `trainerd local`, killed and started again), `tests/fault_tolerance.rs` (a
//! cluster under a supervisor with systemd's semantics, its workers killed, frozen and stopped
//! in every way the fault-tolerance protocol covers). Their harness is `trainerd-testkit`.
