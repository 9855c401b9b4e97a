//! All-reduce latency and bus bandwidth of trainerd's ring, in the format of
//! `../shared/bench/gloo_allreduce.py` so the two print side by side (bench/allreduce.py runs
//! both). Each rank is its own process, as gloo's are; they meet on loopback.
//!
//! Usage: cargo bench -p trainerd --bench allreduce -- WORLD
//! busbw = bytes / seconds * 2(n-1)/n, the traffic each link of the ring carries.

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use trainerd::collective::{AbortSignal, DataListener, ReduceOp, Ring};

/// (bytes, iterations), as the gloo script.
const SIZES: [(usize, usize); 4] = [(4096, 2000), (1 << 20, 200), (25 << 20, 20), (100 << 20, 8)];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    match args.as_slice() {
        [world] => launch(world.parse().expect("WORLD")),
        [rank, ports] if rank.starts_with("--rank=") => {
            let rank: usize = rank["--rank=".len()..].parse().expect("rank");
            let ports: Vec<u16> = ports.split(',').map(|p| p.parse().expect("port")).collect();
            member(rank, &ports);
        }
        _ => eprintln!("usage: allreduce WORLD"),
    }
}

fn launch(world: usize) {
    let ports: Vec<u16> =
        (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()).collect();
    let list = ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> =
        (0..world).map(|r| Command::new(&exe).arg(format!("--rank={r}")).arg(&list).spawn().unwrap()).collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
}

fn member(rank: usize, ports: &[u16]) {
    let world = ports.len();
    let listener = DataListener::bind(([127, 0, 0, 1], ports[rank]).into(), None).unwrap();
    let next: SocketAddr = format!("127.0.0.1:{}", ports[(rank + 1) % world]).parse().unwrap();
    let names: Vec<String> = (0..world).map(|r| format!("rank {r}")).collect();
    let abort = AbortSignal::new();
    let mut ring = Ring::form(&listener, rank, &names, next, 1, Duration::from_secs(60), &abort).unwrap();
    for (bytes, iters) in SIZES {
        let mut x = vec![1.0f32; bytes / 4];
        for _ in 0..3 {
            ring.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        }
        let mut sync = [0f32; 1];
        ring.all_reduce(&mut sync, ReduceOp::Sum).unwrap();
        let mut times = Vec::with_capacity(iters);
        let start = Instant::now();
        for _ in 0..iters {
            let t = Instant::now();
            ring.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            times.push(t.elapsed().as_secs_f64());
        }
        ring.all_reduce(&mut sync, ReduceOp::Sum).unwrap();
        let mean = start.elapsed().as_secs_f64() / iters as f64;
        times.sort_by(f64::total_cmp);
        if rank == 0 {
            let busbw = bytes as f64 / mean / 1e9 * 2.0 * (world - 1) as f64 / world as f64;
            println!(
                "trainerd world={world} bytes={bytes} mean_ms={:.3} median_ms={:.3} busbw_GBps={busbw:.3}",
                mean * 1e3,
                times[iters / 2] * 1e3
            );
        }
    }
}
