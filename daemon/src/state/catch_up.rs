//! One step's outputs as a catch-up carries them (docs/fault-tolerance.md, "A return that does
//! not pause the survivors"): the position before the step, each parameter's averaged gradient
//! as the update reads it (none where the parameter has none), and the buffers after the step.
//! A returner that holds the state before the step puts the gradients in place, runs the same
//! update, and takes the buffers: the state after the step, bit for bit. A sharded step's
//! outputs carry the parameters after the step instead (no member holds its averaged gradient
//! whole, and the returner holds no range of the optimizer state to update with it).

use bytes::Bytes;
use trainerd_storage::TensorData;

use super::host as checkpoint;
use super::position::Position;
use super::replica::{split, Encoding, ModelState};
use super::StateError;

/// The magic of a step's outputs that carry its averaged gradients.
const MAGIC: &[u8; 8] = b"TRDSTEP1";
/// The magic of a step's outputs that carry the parameters after it.
const PARAMS_MAGIC: &[u8; 8] = b"TRDSTPP1";

/// What a step's outputs carry of the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Carried {
    /// Each parameter's averaged gradient, before the update: the returner runs the update.
    Gradients,
    /// The parameters after the step (a sharded step's, as its all-gather left them).
    Parameters,
}

/// A step's outputs, taken apart.
pub(crate) struct StepOutputs {
    /// The position before the step.
    pub(crate) before: Position,
    /// What `tensors` are.
    pub(crate) carried: Carried,
    /// The gradients or the parameters after the step, by parameter name.
    tensors: Vec<TensorData>,
    /// The buffers after the step, by name.
    buffers: Vec<TensorData>,
}

/// The outputs of the step `model` has just reduced (its buffers made the same on every member,
/// its position still the one before the step), as bytes, carrying `carried`: the averaged
/// gradients (copied now, before the update changes them: clipping, unscaling), or the
/// parameters after the step.
pub(crate) fn capture(model: &ModelState, carried: Carried) -> Result<Vec<u8>, StateError> {
    let (magic, tensors): (_, Vec<(String, tch::Tensor)>) = match carried {
        Carried::Gradients => (
            MAGIC,
            model
                .params
                .iter()
                .filter_map(|(n, p)| {
                    let g = p.grad();
                    g.defined().then(|| (format!("grad/{n}"), g))
                })
                .collect(),
        ),
        Carried::Parameters => {
            (PARAMS_MAGIC, model.params.iter().map(|(n, p)| (format!("param/{n}"), p.detach())).collect())
        }
    };
    let buffers = model.buffers.iter().map(|(n, b)| (format!("buffer/{n}"), b.shallow_clone()));
    Encoding::new(magic, &model.position, tensors.into_iter().chain(buffers).collect())?.bytes()
}

impl StepOutputs {
    /// [`capture`]'s bytes, taken apart.
    pub(crate) fn decode(bytes: &Bytes) -> Result<StepOutputs, StateError> {
        let (magic, before, all) = split(bytes, &[MAGIC, PARAMS_MAGIC])?;
        let (carried, prefix) =
            if &magic == MAGIC { (Carried::Gradients, "grad/") } else { (Carried::Parameters, "param/") };
        let (mut tensors, mut buffers) = (Vec::new(), Vec::new());
        for t in all {
            if let Some(name) = t.name.strip_prefix(prefix) {
                tensors.push(TensorData { name: name.to_string(), ..t });
            } else if let Some(name) = t.name.strip_prefix("buffer/") {
                buffers.push(TensorData { name: name.to_string(), ..t });
            } else {
                return Err(StateError::Invalid(match carried {
                    Carried::Gradients => "a step's outputs hold a tensor that is neither a gradient nor a buffer",
                    Carried::Parameters => "a step's outputs hold a tensor that is neither a parameter nor a buffer",
                }));
            }
        }
        Ok(StepOutputs { before, carried, tensors, buffers })
    }

    /// Takes the parameters after the step ([`Carried::Parameters`]), checked against the model
    /// (names, types, shapes).
    pub(crate) fn set_params(&self, model: &mut ModelState) -> Result<(), StateError> {
        if self.carried != Carried::Parameters {
            return Err(StateError::Invalid("a step's outputs carry its gradients, not the parameters after it"));
        }
        checkpoint::copy_into(&mut model.params, &self.tensors, "a step's outputs")
    }

    /// Puts each gradient in its parameter's `.grad` (made where the parameter has none yet); a
    /// parameter without one in the outputs must have none here either (the update skips it).
    pub(crate) fn set_grads(&self, model: &mut ModelState) -> Result<(), StateError> {
        if self.carried != Carried::Gradients {
            return Err(StateError::Invalid("a step's outputs carry the parameters after it, not its gradients"));
        }
        let _no_grad = tch::no_grad_guard();
        for (name, p) in &model.params {
            let Some(g) = self.tensors.iter().find(|g| &g.name == name) else {
                if p.grad().defined() {
                    return Err(StateError::Missing {
                        what: "a step's outputs".into(),
                        name: format!("{name}'s gradient"),
                    });
                }
                continue;
            };
            let shape: Vec<i64> = g.shape.iter().map(|&d| d as i64).collect();
            if shape != p.size() {
                let (found, expected) = (shape, p.size());
                return Err(StateError::Shape { what: "a step's outputs".into(), name: name.clone(), found, expected });
            }
            crate::sys::autograd::ensure_grad(p);
            checkpoint::copy_bytes(&mut p.grad(), g)?;
        }
        if let Some(extra) = self.tensors.iter().find(|g| !model.params.iter().any(|(n, _)| n == &g.name)) {
            return Err(StateError::Missing { what: "the model".into(), name: extra.name.clone() });
        }
        Ok(())
    }

    /// Takes the buffers after the step.
    pub(crate) fn set_buffers(&self, model: &mut ModelState) -> Result<(), StateError> {
        let _no_grad = tch::no_grad_guard();
        checkpoint::copy_into(&mut model.buffers, &self.buffers, "a step's outputs")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::optimizer::Optimizer;
    use crate::state::{Optim, Shareable, TrainState};
    use tch::{Device, Kind, Tensor};
    use trainerd_sdk::OptimizerConfig;

    /// A state of two parameters (one used, one that never gets a gradient) and a buffer.
    fn state(seed: i64) -> TrainState {
        tch::manual_seed(seed);
        let params = vec![
            ("a".to_string(), Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
            ("unused".to_string(), Tensor::randn([2], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
        ];
        let buffers = vec![("count".to_string(), Tensor::from_slice(&[seed]))];
        let optimizer = Optimizer::new(OptimizerConfig::adam(1e-2), &params);
        TrainState::new(ModelState::new((params, buffers), 1, Device::Cpu, true), optimizer)
    }

    /// A step on `s`: a gradient for `a`, the buffer moved on, the update; its outputs.
    fn step(s: &mut TrainState, k: i64) -> Vec<u8> {
        let a = &s.model.params[0].1;
        tch::with_grad(|| (a * a * (k as f64)).sum(Kind::Float).backward());
        let _ = s.model.buffers[0].1.fill_(10 + k);
        let bytes = capture(&s.model, Carried::Gradients).unwrap();
        let Optim::Whole(o) = &mut s.optimizer else { unreachable!("whole") };
        o.step(&mut s.model.params, 0.1);
        s.model.params[0].1.zero_grad();
        s.model.position.global_step += 1;
        bytes
    }

    #[test]
    fn a_steps_outputs_replayed_through_the_same_update_give_the_same_bits() {
        let mut donor = state(1);
        let snapshot = donor.encode().unwrap();
        let outputs: Vec<Vec<u8>> = (1..=3).map(|k| step(&mut donor, k)).collect();
        let mut returner = state(2);
        returner.decode(snapshot.into()).unwrap();
        for bytes in outputs {
            let o = StepOutputs::decode(&bytes.into()).unwrap();
            assert_eq!(o.before, *returner.position());
            o.set_grads(&mut returner.model).unwrap();
            assert!(!returner.model.params[1].1.grad().defined(), "a parameter without a gradient gets none");
            let Optim::Whole(opt) = &mut returner.optimizer else { unreachable!("whole") };
            opt.step(&mut returner.model.params, 0.1);
            o.set_buffers(&mut returner.model).unwrap();
            returner.model.position.global_step += 1;
        }
        assert_eq!(returner.digest().unwrap(), donor.digest().unwrap());
    }

    /// A sharded step's outputs: the parameters and buffers after it, taken as they are.
    #[test]
    fn a_sharded_steps_outputs_carry_the_parameters_after_it() {
        let mut donor = state(1);
        let snapshot = donor.encode().unwrap();
        let mut returner = state(2);
        returner.decode(snapshot.into()).unwrap();
        let before = donor.model.position.clone();
        step(&mut donor, 1);
        donor.model.position = before;
        let bytes = capture(&donor.model, Carried::Parameters).unwrap();
        let o = StepOutputs::decode(&bytes.into()).unwrap();
        assert_eq!((o.carried, &o.before), (Carried::Parameters, returner.position()));
        o.set_params(&mut returner.model).unwrap();
        o.set_buffers(&mut returner.model).unwrap();
        assert_eq!(returner.model.params_sha256(), donor.model.params_sha256());
        let err = o.set_grads(&mut returner.model).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the state received is not valid: a step's outputs carry the parameters after it, not its gradients"
        );
    }

    #[test]
    fn outputs_that_leave_a_gradient_out_are_refused_by_name() {
        let mut donor = state(1);
        let bytes = capture(&donor.model, Carried::Gradients).unwrap();
        step(&mut donor, 1);
        let o = StepOutputs::decode(&bytes.into()).unwrap();
        let err = o.set_grads(&mut donor.model).unwrap_err();
        assert_eq!(err.to_string(), "a step's outputs has no tensor a's gradient");
        let err = StepOutputs::decode(&donor.encode().unwrap().into()).err().expect("a state is not a step's outputs");
        assert_eq!(err.to_string(), "the state received is not valid: no header");
    }
}
