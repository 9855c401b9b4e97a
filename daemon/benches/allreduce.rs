//! All-reduce latency and bus bandwidth of trainerd's ring, in the format of
//! `../shared/bench/gloo_allreduce.py` so the two print side by side (bench/allreduce.py runs
//! both). Each rank is its own process, as gloo's are; they meet on loopback.
//!
//! Usage: cargo bench -p trainerd --bench allreduce -- WORLD [cuda:N]
//! busbw = bytes / seconds * 2(n-1)/n, the traffic each link of the ring carries.
//!
//! With a CUDA device, the buffer lives on the GPU and two paths are timed, as training uses
//! them: `trainerd-nccl` (NCCL send/recv with ring-order sums on the device) and `trainerd-ring`
//! (copied to pinned host memory, the ring, copied back). All ranks share the device, each with
//! its own `NCCL_HOSTID` (NCCL refuses two ranks on one GPU otherwise), so NCCL goes through its
//! socket transport on loopback: compare with `bench/nccl_allreduce.py`, which does the same.

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use trainerd::collective::nccl::{self, Settings};
use trainerd::collective::{AbortSignal, Backend, Collective, DataListener, Link, ReduceOp, Ring, Traffic};

/// (bytes, iterations), as the gloo script.
const SIZES: [(usize, usize); 4] = [(4096, 2000), (1 << 20, 200), (25 << 20, 20), (100 << 20, 8)];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    match args.as_slice() {
        [world] => launch(world.parse().expect("WORLD"), None),
        [rank, ports] if rank.starts_with("--rank=") => {
            let rank: usize = rank["--rank=".len()..].parse().expect("rank");
            let ports: Vec<u16> = ports.split(',').map(|p| p.parse().expect("port")).collect();
            member(rank, &ports);
        }
        [rank, ports, device] if rank.starts_with("--rank=") => {
            let rank: usize = rank["--rank=".len()..].parse().expect("rank");
            let ports: Vec<u16> = ports.split(',').map(|p| p.parse().expect("port")).collect();
            gpu_member(rank, &ports, device);
        }
        [world, device] => launch(world.parse().expect("WORLD"), Some(device)),
        _ => eprintln!("usage: allreduce WORLD [cuda:N]"),
    }
}

fn launch(world: usize, device: Option<&String>) {
    let ports: Vec<u16> =
        (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()).collect();
    let list = ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.arg(format!("--rank={r}")).arg(&list);
            if let Some(d) = device {
                c.arg(d).env("NCCL_HOSTID", format!("trainerd-bench-{r}"));
            }
            c.spawn().unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
}

/// Rank `rank`'s ring over loopback `ports` (and the listener it was formed on).
fn ring_of(rank: usize, ports: &[u16]) -> (DataListener, Ring) {
    let listener = DataListener::bind(([127, 0, 0, 1], ports[rank]).into(), None).unwrap();
    let ring = form(&listener, rank, ports, 1);
    (listener, ring)
}

/// Rank `rank`'s ring of `generation` on `listener`.
fn form(listener: &DataListener, rank: usize, ports: &[u16], generation: u64) -> Ring {
    let world = ports.len();
    let next: SocketAddr = format!("127.0.0.1:{}", ports[(rank + 1) % world]).parse().unwrap();
    let names: Vec<String> = (0..world).map(|r| format!("rank {r}")).collect();
    let link = Link::new(generation, Duration::from_secs(60), &AbortSignal::new(), &Traffic::default());
    Ring::form(listener, rank, &names, next, link).unwrap()
}

fn member(rank: usize, ports: &[u16]) {
    let world = ports.len();
    let (_listener, mut ring) = ring_of(rank, ports);
    for (bytes, iters) in SIZES {
        let mut x = vec![1.0f32; bytes / 4];
        let mut sync = [0f32; 1];
        let cell = std::cell::RefCell::new(&mut ring);
        time(
            "trainerd",
            (rank, world, bytes, iters),
            || cell.borrow_mut().all_reduce(&mut x, ReduceOp::Sum).unwrap(),
            || cell.borrow_mut().all_reduce(&mut sync, ReduceOp::Sum).unwrap(),
        );
    }
}

/// Times `op` over `iters` calls after 3 warm-ups, with a barrier (`sync`) on each side; prints
/// one line as `name` on rank 0.
fn time(
    name: &str,
    (rank, world, bytes, iters): (usize, usize, usize, usize),
    mut op: impl FnMut(),
    mut sync: impl FnMut(),
) {
    for _ in 0..3 {
        op();
    }
    sync();
    let mut times = Vec::with_capacity(iters);
    let start = Instant::now();
    for _ in 0..iters {
        let t = Instant::now();
        op();
        times.push(t.elapsed().as_secs_f64());
    }
    sync();
    let mean = start.elapsed().as_secs_f64() / iters as f64;
    times.sort_by(f64::total_cmp);
    if rank == 0 {
        let busbw = bytes as f64 / mean / 1e9 * 2.0 * (world - 1) as f64 / world as f64;
        println!(
            "{name} world={world} bytes={bytes} mean_ms={:.3} median_ms={:.3} busbw_GBps={busbw:.3}",
            mean * 1e3,
            times[iters / 2] * 1e3
        );
    }
}

/// A rank whose buffer lives on CUDA device `device`: NCCL (generation 1), then the host-staged
/// ring (generation 2).
fn gpu_member(rank: usize, ports: &[u16], device: &str) {
    let index: usize = device.strip_prefix("cuda:").and_then(|n| n.parse().ok()).expect("cuda:N");
    let trainerd::sys::accel::CudaLibrary::Loaded(_) = trainerd::sys::accel::load_cuda(true) else { panic!("no CUDA") };
    let dev = Device::Cuda(index);
    let world = ports.len();
    let (listener, ring) = ring_of(rank, ports);
    let started = Instant::now();
    // The ranks share the GPU (each with its own NCCL_HOSTID): they enter NCCL together, as
    // training does.
    let settings = Settings { version: nccl::library().unwrap().version(), device: index, enter_together: true };
    let mut group = Backend::Nccl(settings).form(ring).unwrap();
    for (bytes, iters) in SIZES {
        let x = Tensor::ones([(bytes / 4) as i64], (Kind::Float, dev));
        let cell = std::cell::RefCell::new(&mut group);
        time(
            "trainerd-nccl",
            (rank, world, bytes, iters),
            || cell.borrow_mut().all_reduce_buffers(&mut [x.shallow_clone()]).unwrap(),
            || cell.borrow_mut().barrier().unwrap(),
        );
        let setup = cell.borrow_mut().take_setup();
        if let Some((what, t)) = setup {
            if rank == 0 {
                println!(
                    "communicator world={world} created_s={:.3} (ready {:.3}s after the start; {what})",
                    t.as_secs_f64(),
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    drop(group);
    let mut ring = form(&listener, rank, ports, 2);
    for (bytes, iters) in SIZES {
        let x = Tensor::ones([(bytes / 4) as i64], (Kind::Float, dev));
        let mut host = Tensor::zeros([(bytes / 4) as i64], (Kind::Float, Device::Cpu)).internal_pin_memory(dev);
        let cell = std::cell::RefCell::new(&mut ring);
        let mut staged = |ring: &mut Ring| {
            host.copy_(&x);
            ring.all_reduce_buffers(&mut [host.shallow_clone()]).unwrap();
            x.shallow_clone().copy_(&host);
        };
        time(
            "trainerd-ring",
            (rank, world, bytes, iters),
            || staged(&mut cell.borrow_mut()),
            || cell.borrow_mut().barrier().unwrap(),
        );
    }
}
