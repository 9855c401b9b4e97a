//! A returner's replay of one step from its catch-up stream (docs/fault-tolerance.md, "By piece"
//! and "By bucket"): the step's buckets that came as the donor's backward pass reduced them, then
//! its outputs, each read piece by piece, every gradient put in place as it arrives and, where the
//! update needs nothing over the whole gradient, the update of its complete elements run
//! meanwhile; else the same update once the gradient is whole.

use std::ops::Range;

use bytes::Bytes;

use super::super::Driver;
use crate::cluster::catch_up::Catching;
use crate::optim::optimizer::RangedRules;
use crate::state::catch_up::{Carried, Incoming};
use crate::state::{Optim, TrainState};

/// What a catch-up replayed: steps, those updated range by range as their pieces came, and the
/// buckets that came during the donor's backward passes.
#[derive(Default)]
pub(super) struct Replayed {
    pub(super) steps: u64,
    pub(super) by_range: u64,
    pub(super) buckets: u64,
}

impl Replayed {
    /// A step replayed (`by_range`: updated range by range).
    pub(super) fn step(&mut self, by_range: bool) {
        self.steps += 1;
        self.by_range += u64::from(by_range);
    }
}

/// A step being taken in, from its first item (a bucket, or its outputs) to its outputs' end.
pub(super) struct Taking {
    /// Its rate.
    lr: f64,
    /// Per parameter, whether its gradient came in a bucket.
    earlier: Vec<bool>,
    /// Whether a bucket decided how the update runs (by range, `rules`, or once whole).
    decided: bool,
    /// The update by range, once made ready: each parameter's rule (`None`: no gradient yet).
    rules: Option<RangedRules>,
    /// The parameters whose gradient came in a bucket and whose update has not run yet.
    held: Vec<usize>,
}

impl Taking {
    /// The rules of the parameters `with` joined to the update by range.
    fn join(&mut self, state: &mut TrainState, with: &[bool]) {
        let (Some(rules), Optim::Whole(o)) = (self.rules.as_mut(), &mut state.optimizer) else { return };
        let more = o.more_ranged(&state.model.params, with, self.lr);
        rules.iter_mut().zip(more).filter(|(_, m)| m.is_some()).for_each(|(r, m)| *r = m);
    }
}

impl Driver<'_> {
    /// The step after the replay's position, about to be taken in.
    pub(super) fn taking(&self, state: &TrainState) -> Taking {
        let lr = self.lr(state.position().global_step, state.position());
        let earlier = vec![false; state.model.params.len()];
        Taking { lr, earlier, decided: false, rules: None, held: Vec::new() }
    }

    /// One bucket's averaged gradients, `total` bytes beginning with `first`, of the step `t`
    /// takes in: each put in its parameter's `.grad` as it arrives and, where the whole update
    /// can run by range with nothing found over the whole gradient (no clip, whose norm comes with
    /// the step's outputs, and no float16 loss scale), updated meanwhile; else held for the
    /// update once the norm, or the whole gradient, is here.
    pub(super) fn take_bucket(
        &mut self,
        state: &mut TrainState,
        catching: &mut Catching,
        t: &mut Taking,
        (total, first): (usize, Bytes),
    ) -> Result<(), String> {
        let mut incoming = Incoming::new(total).after(&t.earlier);
        let (mut carries, mut piece) = (None, first);
        loop {
            let complete = incoming.take(&mut state.model, &piece)?;
            if carries.is_none() {
                if let Some(with) = incoming.carries().map(<[bool]>::to_vec) {
                    let in_place = match incoming.grads_in_place(&state.model) {
                        Some((Carried::Bucket, in_place)) => in_place.is_some(),
                        _ => return Err("a bucket's item holds a step's outputs".into()),
                    };
                    self.rules_for_bucket(state, t, (&with, in_place))?;
                    carries = Some(with);
                }
            }
            self.update_ranges(state, t, (false, None), complete)?;
            if incoming.whole() {
                break;
            }
            piece = catching.more("Bucket", (incoming.got(), total))?;
        }
        incoming.finish(&mut state.model)?;
        for (i, _) in carries.unwrap_or_default().iter().enumerate().filter(|(_, &c)| c) {
            t.earlier[i] = true;
            if t.rules.is_none() {
                t.held.push(i);
            }
        }
        Ok(())
    }

    /// At a bucket's head (its gradients `with`, each written in place as it comes: `in_place`):
    /// the step's first decides how its update runs (by range where it can, every parameter
    /// plain and every gradient in place, else held), the next join it; a bucket that could not
    /// follow an update by range is refused.
    fn rules_for_bucket(
        &self,
        state: &mut TrainState,
        t: &mut Taking,
        (with, in_place): (&[bool], bool),
    ) -> Result<(), String> {
        if t.decided {
            if t.rules.is_some() && !in_place {
                return Err("a bucket's gradients that cannot be updated by range after buckets that were".into());
            }
            t.join(state, with);
            return Ok(());
        }
        t.decided = true;
        let Optim::Whole(o) = &mut state.optimizer else { return Ok(()) };
        let everyone = vec![true; state.model.params.len()];
        let global = !self.cfg.clip.is_off() || state.model.position.loss_scale.is_some();
        if in_place && !global && o.rangeable(&state.model.params, &everyone) {
            t.rules = o.ranged(&state.model.params, with, t.lr);
        }
        Ok(())
    }

    /// One step's outputs, `total` bytes beginning with `first` and read piece by piece from
    /// `catching`, applied to `state` (at the step before them; `t`, the step's buckets taken
    /// before them): each gradient put in place as it arrives and, where the update needs nothing
    /// global but the clip's norm, which then comes first (no float16 loss scale), the update of
    /// its complete elements run meanwhile (and of the buckets' gradients held, once the norm is
    /// here), so that the returner's work ends about when the last piece comes; else the same
    /// update once the gradient is whole. A sharded step's parameters after it are taken instead.
    /// Then the buffers. Whether the update ran range by range.
    pub(super) fn replay(
        &mut self,
        state: &mut TrainState,
        catching: &mut Catching,
        mut t: Taking,
        (total, first): (usize, Bytes),
        slots: usize,
    ) -> Result<bool, String> {
        let at = state.position().global_step;
        let mut incoming = Incoming::new(total).after(&t.earlier);
        // Decided once the head is read: what the outputs carry, and whether the update runs by
        // range.
        let mut ranged: Option<(Carried, bool)> = None;
        let mut piece = first;
        loop {
            let complete = incoming.take(&mut state.model, &piece)?;
            if ranged.is_none() {
                ranged = match incoming.grads_in_place(&state.model) {
                    Some((carried, with)) => Some((carried, self.rules_for_step(state, &mut t, carried, with)?)),
                    None => None,
                };
            }
            if let Some((carried, true)) = ranged {
                self.update_ranges(state, &mut t, (carried == Carried::Clipped, incoming.clip_norm()), complete)?;
            }
            if incoming.whole() {
                break;
            }
            piece = catching.more("Step", (incoming.got(), total))?;
        }
        let lr = t.lr;
        match incoming.finish(&mut state.model)? {
            Carried::Bucket => Err("a step's outputs came as a bucket's".into()),
            Carried::Parameters if t.decided => Err("a sharded step's outputs came after buckets of gradients".into()),
            carried if carried.gradients() && !matches!(state.optimizer, Optim::Whole(_)) => {
                Err("a step's gradients came for a state whose optimizer state is not whole".into())
            }
            carried if carried.gradients() && matches!(ranged, Some((_, true))) => {
                if !t.held.is_empty() {
                    return Err("a step's clipped outputs came without the norm".into());
                }
                self.flip_bit(state);
                Ok(true)
            }
            // The whole update, which finds the same norm in the same gradient.
            Carried::Gradients | Carried::Clipped => {
                self.update(state, (at + 1, lr, None), slots).map(|_| false).map_err(|e| format!("{e:?}"))
            }
            // A sharded step: this process holds no range (the next formation moves its own to it).
            Carried::Parameters => Ok(false),
        }
    }

    /// The update by range `t` made ready, run on the gradients' `complete` elements and, once the
    /// norm that clipped outputs carry first is here (`clipped`, `norm`), or at once unclipped, on
    /// the buckets' gradients held; each range clipped first at the norm, as the update clips the
    /// whole.
    fn update_ranges(
        &self,
        state: &mut TrainState,
        t: &mut Taking,
        (clipped, norm): (bool, Option<f64>),
        complete: Vec<(usize, Range<usize>)>,
    ) -> Result<(), String> {
        let (Some(rules), Optim::Whole(optimizer)) = (&t.rules, &mut state.optimizer) else { return Ok(()) };
        if clipped && norm.is_none() && !complete.is_empty() {
            return Err("a step's outputs: a gradient came before the norm it is clipped at".into());
        }
        let held = if !clipped || norm.is_some() { std::mem::take(&mut t.held) } else { Vec::new() };
        let whole = held.into_iter().map(|i| (i, 0..state.model.params[i].1.numel()));
        for (i, elements) in whole.chain(complete) {
            let (p, rule) = (&state.model.params[i].1, rules[i].expect("a gradient in place has its rule"));
            if let Some(norm) = norm {
                let clipped = self.cfg.clip.clip_elements(&p.grad(), Some(elements.clone()), norm);
                clipped.map_err(|e| format!("clipping a step's gradient: {e}"))?;
            }
            optimizer.update_range(i, rule, (p, &p.grad()), elements);
        }
        Ok(())
    }

    /// At the head of a step's outputs, which carry `carried` (per parameter, whether they carry
    /// its gradient, written in place: `with`): whether the update runs by range, its rules made
    /// ready or joined in `t`. By range when every gradient is written in place and the update
    /// needs no factor over the whole gradient but the clip's, whose norm comes first
    /// ([`Carried::Clipped`]): no float16 loss scale. The step's buckets decided already: their
    /// decision holds, and outputs that could not follow it are refused.
    fn rules_for_step(
        &self,
        state: &mut TrainState,
        t: &mut Taking,
        carried: Carried,
        with: Option<Vec<bool>>,
    ) -> Result<bool, String> {
        if t.rules.is_some() {
            let Some(with) = with.filter(|_| carried == Carried::Gradients) else {
                return Err("a step's outputs that cannot be updated by range after buckets that were".into());
            };
            t.join(state, &with);
            return Ok(true);
        }
        let (true, Some(mut with), Optim::Whole(o)) = (carried.gradients(), with, &mut state.optimizer) else {
            return Ok(false);
        };
        let norm_missing = carried != Carried::Clipped && !self.cfg.clip.is_off();
        if norm_missing || state.model.position.loss_scale.is_some() {
            return Ok(false);
        }
        // The buckets' gradients held join this update.
        with.iter_mut().zip(&t.earlier).for_each(|(w, &e)| *w |= e);
        t.rules = o.ranged(&state.model.params, &with, t.lr);
        Ok(t.rules.is_some())
    }
}
