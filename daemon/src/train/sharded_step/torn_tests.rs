//! Parameters torn by a failed all-gather under `--shard gradients`, put back by the reshard.

use super::tests::{backward, bytes, params, values_of};
use super::*;
use crate::collective::ring::tests::with_ring;
use crate::collective::slots::assign;
use crate::collective::Slots;
use trainerd_sdk::OptimizerConfig;

/// A ring whose all-gathers fail from the `left + 1`th on, on every member at once (as when a
/// member is lost inside one).
#[derive(Debug)]
struct GatherFails<'r> {
    ring: &'r mut dyn Collective,
    left: usize,
}

impl Collective for GatherFails<'_> {
    fn generation(&self) -> u64 {
        self.ring.generation()
    }
    fn rank(&self) -> usize {
        self.ring.rank()
    }
    fn world(&self) -> usize {
        self.ring.world()
    }
    fn slots(&self) -> &Slots {
        self.ring.slots()
    }
    fn on_device(&self) -> bool {
        self.ring.on_device()
    }
    fn all_reduce_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        self.ring.all_reduce_buffers(bufs)
    }
    fn reduce_scatter_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        self.ring.reduce_scatter_buffers(bufs)
    }
    fn all_gather_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        if self.left == 0 {
            return Err(CollectiveError::Unsupported { op: "an all-gather past the test's failure" });
        }
        self.left -= 1;
        self.ring.all_gather_buffers(bufs)
    }
    fn shift_to_next(&mut self, send: &[&[f32]], recv: &mut [&mut [f32]]) -> Result<(), CollectiveError> {
        self.ring.shift_to_next(send, recv)
    }
    fn shift_to_previous(&mut self, send: &[&[f32]], recv: &mut [&mut [f32]]) -> Result<(), CollectiveError> {
        self.ring.shift_to_previous(send, recv)
    }
    fn all_reduce_values(&mut self, bufs: &mut [&mut [f64]], op: ReduceOp) -> Result<(), CollectiveError> {
        self.ring.all_reduce_values(bufs, op)
    }
    fn all_reduce_workers(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<(), CollectiveError> {
        self.ring.all_reduce_workers(buf, op)
    }
    fn broadcast(&mut self, root: usize, buf: &mut [u8]) -> Result<(), CollectiveError> {
        self.ring.broadcast(root, buf)
    }
    fn broadcast_bytes(&mut self, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        self.ring.broadcast_bytes(root, bytes)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.ring.barrier()
    }
    fn check_abort(&self) -> Result<(), CollectiveError> {
        self.ring.check_abort()
    }
}

/// `--shard gradients` on 3 workers (Adam): 3 steps, the second failing inside its all-gather
/// after `gathered` buckets (every member at once) when given; the reshard after it puts the
/// parameters it tore back, and the step is trained again. Per member: the parameters' bits,
/// the buckets the reshard put back, and whether the failed step had changed the parameters.
fn three_steps_torn(gathered: Option<usize>) -> Vec<(Vec<Vec<u32>>, usize, bool)> {
    let config = OptimizerConfig::Adam { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
    with_ring(3, |ring| {
        ring.set_slots(Slots::of(3, assign(3, &[0, 1, 2]), ring.rank()));
        let mut params = params();
        let mut buckets = Buckets::new(&params, 64);
        buckets.set_compact(true);
        let ranges = buckets.ranges(&params, 3, 2);
        let (mine, buddied) = holding(&ranges, ring);
        let held = (&with_pieces(&ranges, &mine)[..], &with_pieces(&ranges, &buddied)[..]);
        let mut optimizer = ShardedOptimizer::new(config.clone(), &params, held);
        let (mut repaired, mut changed, mut failed) = (0, false, false);
        let mut step = 0;
        while step < 3 {
            let slot = ring.slots().iter().next().unwrap();
            backward(&mut params, slot, step);
            buckets.stage(0, &params, &[1.0, 2.0]);
            let on = (&mut buckets, &ranges[..]);
            let how = (&Clip::default(), 0.01, None);
            let fails = gathered.filter(|_| step == 1 && !failed);
            let before = values_of(&params);
            let stepped = match fails {
                Some(left) => {
                    let mut failing = GatherFails { ring: &mut *ring, left };
                    reduce_and_update(on, &mut failing, &mut params, &mut optimizer, how, (2, None, &[]))
                }
                None => reduce_and_update(on, ring, &mut params, &mut optimizer, how, (2, None, &[])),
            };
            if stepped.is_err() {
                (failed, changed) = (true, values_of(&params) != before);
                let (next, forward, moves) =
                    reshard((&mut buckets, &ranges, 2), ring, &params, &mut optimizer).unwrap().unwrap();
                assert!(!forward, "no member completed the step: it goes back");
                (optimizer, repaired) = (next, moves.repaired);
                continue; // the same step again
            }
            step += 1;
        }
        (params.iter().map(|(_, p)| bytes(p)).collect(), repaired, changed)
    })
}

#[test]
fn parameters_torn_by_a_failed_all_gather_are_put_back_and_the_step_trained_again_bit_for_bit() {
    let straight = three_steps_torn(None);
    // The buckets: [p0 and the tail], [p1], [p2], [p3, p4, p5], [p6]. A failure in the second's
    // all-gather (one parameter, gathered in place) leaves it torn too; in the fourth's, not.
    for (gathered, torn) in [(1, 2), (3, 3)] {
        let out = three_steps_torn(Some(gathered));
        for (w, (params, repaired, changed)) in out.into_iter().enumerate() {
            assert!(changed, "worker {w}: the failed all-gather wrote {gathered} bucket(s) of the parameters");
            assert_eq!(repaired, torn, "worker {w}: the buckets put back");
            assert_eq!(params, straight[w].0, "worker {w}: after {gathered} bucket(s) gathered");
        }
    }
}
