use super::*;
use proptest::prelude::*;

/// Forms a ring of `world` ranks on loopback and runs `f` on each, in threads.
pub(crate) fn with_ring<R: Send>(world: usize, f: impl Fn(&mut Ring) -> R + Sync) -> Vec<R> {
    with_ring_timeout(world, Duration::from_secs(20), |ring, _| f(ring))
}

/// As [`with_ring`], with a collective timeout, and each rank's abort signal.
pub(crate) fn with_ring_timeout<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&mut Ring, &AbortSignal) -> R + Sync,
) -> Vec<R> {
    let listeners: Vec<DataListener> =
        (0..world).map(|_| DataListener::bind("127.0.0.1:0".parse().unwrap(), None).unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(DataListener::local_addr).collect();
    let names: Vec<String> = (0..world).map(|r| format!("worker {r}")).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(rank, listener)| {
                let (names, addrs, f) = (&names, &addrs, &f);
                s.spawn(move || {
                    let abort = AbortSignal::new();
                    let link = Link::new(1, timeout, &abort, &Traffic::default());
                    let mut ring = Ring::form(listener, rank, names, addrs[(rank + 1) % world], link).unwrap();
                    f(&mut ring, &abort)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// For random sets of tensors and world sizes 1-5, all-reduce equals the directly
    /// computed sum and is bit-identical on every rank.
    #[test]
    fn all_reduce_is_the_sum_and_identical_everywhere(
        world in 1usize..=5,
        lens in proptest::collection::vec(prop_oneof![0usize..8, 0usize..3000], 1..4),
        seed in any::<u64>(),
    ) {
        let data = |rank: usize, t: usize, i: usize| -> f32 {
            let x = (seed ^ ((rank as u64) << 40) ^ ((t as u64) << 20) ^ i as u64).wrapping_mul(0x9E3779B97F4A7C15);
            ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let results = with_ring(world, |ring| {
            let rank = ring.rank();
            lens.iter()
                .enumerate()
                .map(|(t, &len)| {
                    let mut buf: Vec<f32> = (0..len).map(|i| data(rank, t, i)).collect();
                    ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    buf
                })
                .collect::<Vec<_>>()
        });
        for (t, &len) in lens.iter().enumerate() {
            for (i, &got) in results[0][t].iter().enumerate().take(len) {
                let direct: f64 = (0..world).map(|r| f64::from(data(r, t, i))).sum();
                prop_assert!((f64::from(got) - direct).abs() < 1e-5, "tensor {t}[{i}]");
            }
            for (r, result) in results.iter().enumerate().skip(1) {
                let same = result[t].iter().zip(&results[0][t]).all(|(a, b)| a.to_bits() == b.to_bits());
                prop_assert!(same, "rank {r} differs from rank 0 in tensor {t}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// However V slots are spread over the workers present (wrapping past the last slot too),
    /// the reduction is bit for bit the
    /// V-worker ring's (sums and means, float32 and float64), on every worker.
    #[test]
    fn slots_reduce_exactly_as_the_full_ring(
        count in 1usize..=5,
        workers in 1usize..=5,
        len in prop_oneof![0usize..7, 0usize..5000],
        seed in any::<u64>(),
        home in any::<bool>(),
    ) {
        let workers = workers.min(count);
        let value = |slot: usize, i: usize| -> f32 {
            let x = (seed ^ ((slot as u64) << 40) ^ i as u64).wrapping_mul(0x9E3779B97F4A7C15);
            ((x >> 40) as f32 / (1u64 << 20) as f32) - 7.5
        };
        let full = with_ring(count, |ring| {
            let mut buf: Vec<f32> = (0..len).map(|i| value(ring.rank(), i)).collect();
            ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            let mut wide: Vec<f64> = (0..len).map(|i| f64::from(value(ring.rank(), i)) / 3.0).collect();
            ring.all_reduce(&mut wide, ReduceOp::Mean).unwrap();
            (buf, wide)
        });
        // Balanced slots, or home slots for the last `workers` ranks (rank 0 absent: the
        // last worker's slots wrap past the last slot).
        let ranges = match home {
            false => crate::collective::slots::assign(count, &(0..workers).collect::<Vec<_>>()),
            true => crate::collective::slots::assign_home(count, count, &(count - workers..count).collect::<Vec<_>>()),
        };
        let short = with_ring(workers, |ring| {
            ring.set_slots(Slots::of(count, ranges.clone(), ring.rank()));
            let held: Vec<usize> = ring.slots().iter().collect();
            let mut bufs: Vec<Vec<f32>> = held.iter().map(|&s| (0..len).map(|i| value(s, i)).collect()).collect();
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            ring.all_reduce_slots(&mut views, ReduceOp::Sum).unwrap();
            let mut wide: Vec<Vec<f64>> =
                held.iter().map(|&s| (0..len).map(|i| f64::from(value(s, i)) / 3.0).collect()).collect();
            let mut views: Vec<&mut [f64]> = wide.iter_mut().map(Vec::as_mut_slice).collect();
            ring.all_reduce_slots(&mut views, ReduceOp::Mean).unwrap();
            (bufs.swap_remove(0), wide.swap_remove(0))
        });
        let bits32 = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let bits64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (w, (sum, mean)) in short.iter().enumerate() {
            prop_assert_eq!(bits32(sum), bits32(&full[0].0), "worker {} of {}: sum", w, workers);
            prop_assert_eq!(bits64(mean), bits64(&full[0].1), "worker {} of {}: mean", w, workers);
        }
    }
}

#[test]
fn buffers_shorter_than_the_ring() {
    for world in 2..=4 {
        let out = with_ring(world, |ring| {
            let mut x = [ring.rank() as f32 + 1.0];
            ring.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            let mut empty: [f32; 0] = [];
            ring.all_reduce(&mut empty, ReduceOp::Sum).unwrap();
            x[0]
        });
        let expected = (world * (world + 1) / 2) as f32;
        assert!(out.iter().all(|&x| x == expected), "{world}: {out:?}");
    }
}

/// A shift takes each side's slices in order as one stream, however each side cuts it: the
/// previous worker's values arrive whole and in order, both ways round.
#[test]
fn a_shift_carries_the_slices_in_order_however_each_side_cuts_them() {
    let world = 3;
    let sent = |rank: usize| -> Vec<f32> { (0..1000).map(|i| (rank * 10_000 + i) as f32).collect() };
    let cuts: [&[usize]; 3] = [&[0, 7, 500, 1000], &[0, 0, 999, 1000], &[0, 1000]];
    let results = with_ring(world, |ring| {
        let rank = ring.rank();
        let values = sent(rank);
        let send: Vec<&[f32]> = cuts[rank].windows(2).map(|w| &values[w[0]..w[1]]).collect();
        let mut ways = Vec::new();
        for forward in [true, false] {
            let mut got = vec![0.0f32; 1000];
            let cut = cuts[(rank + 1) % world];
            let mut rest = got.as_mut_slice();
            let mut recv = Vec::new();
            for w in cut.windows(2) {
                let (part, tail) = rest.split_at_mut(w[1] - w[0]);
                recv.push(part);
                rest = tail;
            }
            match forward {
                true => ring.shift(&send, &mut recv).unwrap(),
                false => ring.shift_back(&send, &mut recv).unwrap(),
            }
            ways.push(got);
        }
        ways
    });
    for (rank, ways) in results.iter().enumerate() {
        assert_eq!(ways[0], sent((rank + world - 1) % world), "from the previous worker, at {rank}");
        assert_eq!(ways[1], sent((rank + 1) % world), "from the next worker, at {rank}");
    }
}

#[test]
fn disjoint_handles_empty_chunks() {
    let mut buf = [1, 2, 3];
    let (a, b) = disjoint(&mut buf, 0..0, 0..1);
    assert_eq!((a.len(), b.len()), (0, 1));
    let (a, b) = disjoint(&mut buf, 0..1, 1..1);
    assert_eq!((a, b.len()), (&[1][..], 0));
    let (a, b) = disjoint(&mut buf, 2..3, 0..2);
    assert_eq!((a, &*b), (&[3][..], &[1, 2][..]));
}

#[test]
fn mean_and_broadcast() {
    let out = with_ring(3, |ring| {
        let mut m = vec![ring.rank() as f64 + 1.0; 5];
        ring.all_reduce(&mut m, ReduceOp::Mean).unwrap();
        let mut b: Vec<f32> =
            if ring.rank() == 0 { (0..3_000_000).map(|i| i as f32).collect() } else { vec![0.0; 3_000_000] };
        ring.broadcast_from(0, &mut b).unwrap();
        (m, b[2_999_999], b[12345])
    });
    for (m, last, mid) in out {
        assert_eq!(m, vec![2.0; 5]);
        assert_eq!((last, mid), (2_999_999.0, 12345.0));
    }
}

#[test]
fn bytes_broadcast_from_any_root() {
    for root in 0..3 {
        let out = with_ring(3, |ring| {
            let mine = if ring.rank() == root { (0..3_000_001u32).map(|i| (i % 251) as u8).collect() } else { vec![9] };
            ring.broadcast_bytes(root, mine).unwrap()
        });
        for (rank, got) in out.iter().enumerate() {
            assert_eq!(got.len(), 3_000_001, "root {root}, rank {rank}");
            assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "root {root}, rank {rank}");
        }
    }
}

#[test]
fn a_silent_peer_is_a_timeout_naming_it() {
    let out = with_ring_timeout(2, Duration::from_millis(500), |ring, _| {
        if ring.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return String::new();
        }
        let mut buf = vec![1.0f32; 10];
        ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err().to_string()
    });
    assert_eq!(out[0], "all-reduce: worker 1 sent nothing for 500ms; it may have died or hung");
}

#[test]
fn an_abort_ends_a_blocked_collective_at_once_and_names_why() {
    let out = with_ring_timeout(3, Duration::from_secs(60), |ring, abort| {
        if ring.rank() == 2 {
            // Never enters the collective; its peer aborts after 100 ms.
            std::thread::sleep(Duration::from_millis(100));
            abort.trigger(1, "worker 2 is being replaced");
            return (String::new(), Duration::ZERO);
        }
        let started = Instant::now();
        let mut buf = vec![1.0f32; 1 << 20];
        let err = ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        (err.to_string(), started.elapsed())
    });
    // Rank 2's sockets were shut down: its neighbours' reads end, not after 60 s.
    for (rank, (err, took)) in out.iter().enumerate().take(2) {
        assert!(err.starts_with("all-reduce: connection to worker "), "rank {rank}: {err}");
        assert!(*took < Duration::from_secs(10), "rank {rank} waited {took:?}");
    }
}
