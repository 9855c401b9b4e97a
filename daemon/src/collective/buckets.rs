//! Tensors over the ring, staged through host memory as float32: [`broadcast`] of parameters
//! and optimizer state, and gradient averaging: the parameters' gradients are fused into buckets of at most a fixed size
//! (small tensors travel together, one collective per bucket), staged through host memory (on
//! CUDA too, as TensorFlow's RING does), averaged over the ring, and written back.
//!
//! A few extra values (the step's loss and metric sums) ride along in the last bucket, summed
//! rather than averaged, so that the progress line shows global figures at no extra cost.

use tch::{Device, Kind, Tensor};

use super::ring::{CollectiveError, ReduceOp, Ring};

/// Copies `t` (any device, any float kind) into `dst` as float32: the host staging every
/// collective over tensors goes through.
fn stage_out(t: &Tensor, dst: &mut [f32]) {
    t.detach().to_device(Device::Cpu).to_kind(Kind::Float).contiguous().copy_data(dst, dst.len());
}

/// `src` as a CPU tensor shaped like `like` (`copy_` moves it to `like`'s device and kind).
fn stage_in(src: &[f32], like: &Tensor) -> Tensor {
    Tensor::from_slice(src).view(like.size().as_slice())
}

/// Copies rank 0's values of `tensors` to every rank, in place, as one fused buffer.
pub fn broadcast(ring: &mut Ring, tensors: &mut [(String, Tensor)]) -> Result<(), CollectiveError> {
    if ring.world() == 1 {
        return Ok(());
    }
    let numels: Vec<usize> = tensors.iter().map(|(_, t)| t.numel()).collect();
    let mut flat = vec![0f32; numels.iter().sum()];
    let mut at = 0;
    for ((_, t), &n) in tensors.iter().zip(&numels) {
        stage_out(t, &mut flat[at..at + n]);
        at += n;
    }
    ring.broadcast(&mut flat)?;
    let _no_grad = tch::no_grad_guard();
    let mut at = 0;
    for ((_, t), &n) in tensors.iter_mut().zip(&numels) {
        t.copy_(&stage_in(&flat[at..at + n], t));
        at += n;
    }
    Ok(())
}

/// Default bucket size, as PyTorch DDP's `bucket_cap_mb`.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Which parameters go in which bucket.
#[derive(Debug)]
pub struct Buckets {
    /// Parameter indices per bucket, in parameter order.
    groups: Vec<Vec<usize>>,
}

impl Buckets {
    /// Groups `params` (in order) into buckets of at most `cap_bytes` of float32 each (a larger
    /// tensor gets a bucket of its own).
    pub fn new(params: &[(String, Tensor)], cap_bytes: usize) -> Buckets {
        let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
        let mut bytes = 0;
        for (i, (_, p)) in params.iter().enumerate() {
            let size = p.numel() * 4;
            if bytes + size > cap_bytes && !groups.last().expect("one group").is_empty() {
                groups.push(Vec::new());
                bytes = 0;
            }
            groups.last_mut().expect("one group").push(i);
            bytes += size;
        }
        Buckets { groups }
    }

    /// Number of buckets.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// True when there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.groups.iter().all(Vec::is_empty)
    }

    /// Replaces every gradient with its mean over the ring, and `extra` with its sum.
    pub fn all_reduce(
        &self,
        ring: &mut Ring,
        params: &mut [(String, Tensor)],
        extra: &mut [f32],
    ) -> Result<(), CollectiveError> {
        if ring.world() == 1 {
            return Ok(());
        }
        let last = self.groups.len() - 1;
        for (b, group) in self.groups.iter().enumerate() {
            let numels: Vec<usize> = group.iter().map(|&i| params[i].1.numel()).collect();
            let grads_len: usize = numels.iter().sum();
            let tail = if b == last { extra.len() } else { 0 };
            let mut flat = vec![0f32; grads_len + tail];
            let mut at = 0;
            for (&i, &n) in group.iter().zip(&numels) {
                let g = params[i].1.grad();
                if g.defined() {
                    stage_out(&g, &mut flat[at..at + n]);
                }
                at += n;
            }
            if tail > 0 {
                flat[grads_len..].copy_from_slice(extra);
            }
            ring.all_reduce(&mut flat, ReduceOp::Sum)?;
            let scale = 1.0 / ring.world() as f32;
            flat[..grads_len].iter_mut().for_each(|x| *x *= scale);
            let mut at = 0;
            for (&i, &n) in group.iter().zip(&numels) {
                let p = &mut params[i].1;
                let mean = stage_in(&flat[at..at + n], p);
                if !p.grad().defined() {
                    // A parameter without a gradient here may have one on another worker: give
                    // it a zero gradient (through autograd, which owns `.grad`) to copy into.
                    (p.sum(Kind::Float) * 0.0).backward();
                }
                p.grad().copy_(&mean);
                at += n;
            }
            if tail > 0 {
                extra.copy_from_slice(&flat[grads_len..]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(sizes: &[i64]) -> Vec<(String, Tensor)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("p{i}"), Tensor::zeros([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)))
            .collect()
    }

    #[test]
    fn small_tensors_share_buckets() {
        let b = Buckets::new(&params(&[10, 10, 10, 1000, 5]), 100);
        assert_eq!(b.groups, vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        let b = Buckets::new(&params(&[10, 10, 10]), DEFAULT_BUCKET_BYTES);
        assert_eq!(b.groups, vec![vec![0, 1, 2]]);
    }

    #[test]
    fn gradients_are_averaged_and_extras_summed() {
        let out = crate::collective::ring::tests::with_ring(3, |ring| {
            let mut ps = params(&[4, 6]);
            let r = ring.rank() as f64;
            for (_, p) in ps.iter_mut() {
                (p.sum(Kind::Float) * (r + 1.0)).backward();
            }
            let mut extra = [r as f32, 1.0];
            Buckets::new(&ps, 16).all_reduce(ring, &mut ps, &mut extra).unwrap();
            let g: Vec<f32> = ps.iter().flat_map(|(_, p)| Vec::<f32>::try_from(p.grad()).unwrap()).collect();
            (g, extra)
        });
        for (g, extra) in out {
            assert_eq!(g, vec![2.0; 10]);
            assert_eq!(extra, [3.0, 3.0]);
        }
    }
}
