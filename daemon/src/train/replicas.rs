//! A daemon's several devices (`--devices`, as TensorFlow's MirroredStrategy): one model instance
//! per device. Each replica is a slot of the run ([`crate::collective::slots`]) with its own slice
//! of the global batch, dropout seed, buffers, gradient and place in the reduction, so a daemon
//! with D replicas is, bit for bit, D workers of one. The first replica's variables are the state:
//! the optimizer updates them, the checkpoint holds them (once per daemon), a peer receives them.
//! The others take them at every step's start, so they can never drift, whatever changed the state
//! (an update, a restore, a state received from a peer).

use tch::{Device, Tensor};

use super::error::TrainError;
use super::step::{Replica, Variables};
use crate::optim::precision::Precision;
use crate::plugin::{ModelInstance, Named, Plugin};

/// The replicas after the first, each a model instance on its own device.
pub(crate) struct Replicas<'p> {
    /// The first replica's device (the run's `device`).
    first: Device,
    /// The forward pass's precision, the same on every replica.
    precision: Precision,
    others: Vec<Other<'p>>,
}

struct Other<'p> {
    model: ModelInstance<'p>,
    device: Device,
    params: Named,
    buffers: Named,
}

impl<'p> Replicas<'p> {
    /// The plugin's model built on every device of `devices` after the first (whose instance the
    /// run already has).
    pub(crate) fn build(
        plugin: &'p Plugin,
        devices: &[Device],
        precision: Precision,
    ) -> Result<Replicas<'p>, TrainError> {
        let mut others = Vec::with_capacity(devices.len().saturating_sub(1));
        for &device in devices.iter().skip(1) {
            let model = plugin.create_model(crate::plugin::MODEL_PATH, device)?;
            let (params, buffers) = model.split_variables();
            others.push(Other { model, device, params, buffers });
        }
        Ok(Replicas { first: devices.first().copied().unwrap_or(Device::Cpu), precision, others })
    }

    /// The replicas of one step, the first being `model` with the state's `variables`; the others
    /// take those variables' values first.
    pub(crate) fn of_step<'s>(
        &'s mut self,
        model: &'s ModelInstance<'p>,
        (params, buffers): Variables<'s>,
        loss_scale: f64,
    ) -> Result<Vec<Replica<'s>>, TrainError> {
        let _no_grad = tch::no_grad_guard();
        let copy = |to: &mut [(String, Tensor)], from: &[(String, Tensor)]| {
            to.iter_mut().zip(from).try_for_each(|((_, t), (_, f))| t.f_copy_(f))
        };
        for o in &mut self.others {
            copy(&mut o.params, params)
                .and_then(|()| copy(&mut o.buffers, buffers))
                .map_err(|source| TrainError::Torch { what: "copying the variables to a replica", source })?;
        }
        let precision = self.precision;
        let mut all = vec![Replica { model, device: self.first, params, buffers, precision, loss_scale }];
        for o in &mut self.others {
            let (model, device, params, buffers) = (&o.model, o.device, &mut o.params, &mut o.buffers);
            all.push(Replica { model, device, params, buffers, precision, loss_scale });
        }
        Ok(all)
    }
}
