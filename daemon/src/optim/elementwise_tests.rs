//! The element-wise loops ([`Rule::apply`]) against the same operations spelled one element at a
//! time: every rule's loop (Adam's has tests of its own, against PyTorch's) gives those bits, in place or read from one
//! slice and written into another ([`ReadInto`]), and a sharded update's two passes (the new
//! parameters, then the state) give the bits of one.

use super::elementwise::{KerasClip, Rule};
use super::lanes::{ReadInto, Write};

fn values(n: usize, f: f32, scale: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * f).sin() * scale).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One element of `rule`'s update, spelled out: (new parameter, new state values).
fn reference(rule: Rule, p: f32, g: f32, s: &[f32], first: bool) -> (f32, Vec<f32>) {
    match rule {
        Rule::Sgd { wd, momentum, keep, nesterov, neg_lr } => {
            let mut d = if wd != 0.0 { g + p * wd } else { g };
            let mut out = Vec::new();
            if momentum != 0.0 {
                let buf = if first { d } else { s[0] * momentum + d * keep };
                out.push(buf);
                d = if nesterov { d + buf * momentum } else { buf };
            }
            (p + d * neg_lr, out)
        }
        Rule::KerasAdam { shrink, clip, betas: [b1, one_b1, b2, one_b2], eps, alpha } => {
            let (p, g) = keras_inputs(shrink, clip, p, g);
            let m = s[0] * b1 + one_b1 * g;
            let v = s[1] * b2 + one_b2 * (g * g);
            (p - (m * alpha) / (v.sqrt() + eps), vec![m, v])
        }
        Rule::Rmsprop { wd, alpha: [alpha, one_alpha], eps, momentum, centered, neg_lr } => {
            let g = if wd != 0.0 { g + p * wd } else { g };
            let square = s[0] * alpha + g * one_alpha * g;
            let mut out = vec![square];
            let mut avg = square.sqrt() + eps;
            if centered {
                let grad_avg = s[s.len() - 1] * alpha + g * one_alpha;
                avg = (square - grad_avg * grad_avg).sqrt() + eps;
                out.push(grad_avg);
            }
            match momentum {
                Some(m) => {
                    let buf = s[1] * m + g / avg;
                    out.insert(1, buf);
                    (p + buf * neg_lr, out)
                }
                None => (p + g * neg_lr / avg, out),
            }
        }
        Rule::KerasSgd { shrink, clip, momentum, nesterov, neg_lr } => {
            let (p, g) = keras_inputs(shrink, clip, p, g);
            if momentum == 0.0 {
                return (p + neg_lr * g, vec![]);
            }
            let m = s[0] * momentum + neg_lr * g;
            (if nesterov { (p + neg_lr * g) + momentum * m } else { p + m }, vec![m])
        }
        Rule::KerasRmsprop { .. } => keras_rmsprop(rule, p, g, s),
        Rule::Adam { .. } => unreachable!("Adam's loop has tests of its own, against PyTorch's"),
    }
}

/// One element of Keras's RMSprop, spelled out.
fn keras_rmsprop(rule: Rule, p: f32, g: f32, s: &[f32]) -> (f32, Vec<f32>) {
    let Rule::KerasRmsprop { shrink, clip, rho: [rho, one_rho], eps, momentum, centered, lr } = rule else {
        unreachable!("Keras's RMSprop")
    };
    let (p, g) = keras_inputs(shrink, clip, p, g);
    let v = s[0] * rho + one_rho * (g * g);
    let mut out = vec![v];
    let mut denom = v + eps;
    if centered {
        let a = s[s.len() - 1] * rho + one_rho * g;
        denom -= a * a;
        out.push(a);
    }
    let increment = (g * lr) / denom.sqrt();
    match momentum {
        Some(mo) => {
            let o = s[1] * mo + increment;
            out.insert(1, o);
            (p - o, out)
        }
        None => (p - increment, out),
    }
}

/// Keras's parameter after its decoupled decay, and its gradient after `clipnorm`.
fn keras_inputs(shrink: Option<f32>, clip: Option<KerasClip>, p: f32, g: f32) -> (f32, f32) {
    (shrink.map_or(p, |s| p * s), clip.map_or(g, |c| g * c.clipnorm / c.divisor))
}

/// `rule` on 37 elements (the vector loops' remainders included): in place storing both, and
/// read into another slice in two passes; each the reference's bits.
fn check(rule: Rule, first: bool) {
    let n = 37;
    let (p, g) = (values(n, 0.7, 0.5), values(n, 1.3, 0.2));
    let state: Vec<Vec<f32>> =
        (0..rule.state_len()).map(|k| values(n, 0.3 + k as f32, 0.01).iter().map(|x| x.abs()).collect()).collect();
    let mut want_p = vec![0.0; n];
    let mut want_s = state.clone();
    for i in 0..n {
        let s: Vec<f32> = state.iter().map(|s| s[i]).collect();
        let (np, ns) = reference(rule, p[i], g[i], &s, first);
        want_p[i] = np;
        ns.iter().enumerate().for_each(|(k, &x)| want_s[k][i] = x);
    }
    let case = format!("{rule:?}, first {first}");
    // In place, both stored.
    let (mut in_place, mut s1) = (p.clone(), state.clone());
    let mut slices: Vec<&mut [f32]> = s1.iter_mut().map(Vec::as_mut_slice).collect();
    rule.apply(in_place.as_mut_slice(), &g, &mut slices, first, Write::Both);
    assert_eq!(bits(&in_place), bits(&want_p), "{case}: parameters in place");
    for (got, want) in s1.iter().zip(&want_s) {
        assert_eq!(bits(got), bits(want), "{case}: state in place");
    }
    // Read from `p`, written into another slice, then the state in a second pass.
    let (mut into, mut s2) = (vec![0.0; n], state.clone());
    let mut slices: Vec<&mut [f32]> = s2.iter_mut().map(Vec::as_mut_slice).collect();
    rule.apply(&mut ReadInto::new(&p, Some(&mut into)), &g, &mut slices, first, Write::Params);
    assert_eq!(bits(&into), bits(&want_p), "{case}: parameters read into another slice");
    assert!(slices.iter().zip(&state).all(|(s, t)| bits(s) == bits(t)), "{case}: the first pass stores no state");
    rule.apply(&mut ReadInto::new(&p, None), &g, &mut slices, first, Write::State);
    for (got, want) in s2.iter().zip(&want_s) {
        assert_eq!(bits(got), bits(want), "{case}: state of the second pass");
    }
}

#[test]
fn every_loop_but_adams_gives_the_bits_of_its_operations_one_element_at_a_time() {
    for (momentum, nesterov, wd) in [(0.0, false, 0.0), (0.0, false, 1e-3), (0.9, false, 0.0), (0.9, true, 1e-3)] {
        let rule = Rule::Sgd { wd, momentum, keep: 0.9, nesterov, neg_lr: -0.05 };
        check(rule, true);
        check(rule, false);
    }
    for (shrink, clip) in [(None, None), (Some(0.999_6), Some(KerasClip { clipnorm: 1.0, divisor: 1.7 }))] {
        let rule = Rule::KerasAdam { shrink, clip, betas: [0.9, 0.1, 0.999, 0.001], eps: 1e-7, alpha: 3e-4 };
        check(rule, false);
    }
    let keras_clip = Some(KerasClip { clipnorm: 1.0, divisor: 1.7 });
    for (momentum, centered) in [(None, false), (Some(0.9), false), (None, true), (Some(0.9), true)] {
        for wd in [0.0, 1e-3] {
            let rule = Rule::Rmsprop { wd, alpha: [0.99, 0.01], eps: 1e-8, momentum, centered, neg_lr: -0.01 };
            check(rule, false);
        }
        for (shrink, clip) in [(None, None), (Some(0.999_6), keras_clip)] {
            let rule = Rule::KerasRmsprop { shrink, clip, rho: [0.9, 0.1], eps: 1e-7, momentum, centered, lr: 1e-3 };
            check(rule, false);
        }
    }
    for (momentum, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
        for (shrink, clip) in [(None, None), (Some(0.999_6), keras_clip)] {
            check(Rule::KerasSgd { shrink, clip, momentum, nesterov, neg_lr: -0.05 }, false);
        }
    }
}
