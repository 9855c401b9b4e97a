//! The element-wise loops ([`Rule::apply`]) against the same operations spelled one element at a
//! time: each rule whose loop runs over zipped slices gives those bits, in place or read from one
//! slice and written into another ([`ReadInto`]), and a sharded update's two passes (the new
//! parameters, then the state) give the bits of one.

use super::elementwise::{KerasClip, ReadInto, Rule, Write};

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
            let p = shrink.map_or(p, |s| p * s);
            let g = clip.map_or(g, |c| g * c.clipnorm / c.divisor);
            let m = s[0] * b1 + one_b1 * g;
            let v = s[1] * b2 + one_b2 * (g * g);
            (p - (m * alpha) / (v.sqrt() + eps), vec![m, v])
        }
        _ => unreachable!("the rules this test covers"),
    }
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
fn sgd_and_keras_adam_loops_give_the_bits_of_their_operations_one_element_at_a_time() {
    for (momentum, nesterov, wd) in [(0.0, false, 0.0), (0.0, false, 1e-3), (0.9, false, 0.0), (0.9, true, 1e-3)] {
        let rule = Rule::Sgd { wd, momentum, keep: 0.9, nesterov, neg_lr: -0.05 };
        check(rule, true);
        check(rule, false);
    }
    for (shrink, clip) in [(None, None), (Some(0.999_6), Some(KerasClip { clipnorm: 1.0, divisor: 1.7 }))] {
        let rule = Rule::KerasAdam { shrink, clip, betas: [0.9, 0.1, 0.999, 0.001], eps: 1e-7, alpha: 3e-4 };
        check(rule, false);
    }
}
