//! One batch as a model receives it: named tensors (columns), each with the batch's examples along
//! its first dimension. An image classifier's batch is `image` and `label`; a language model's is
//! `input_ids` and `attention_mask`, with or without labels.

use tch::Tensor;

use crate::error::PluginError;

/// The name of the column that holds the labels, when a dataset has them.
pub const LABEL: &str = "label";

/// The name of the padding mask of token columns: 1 for a real token, 0 for padding.
pub const ATTENTION_MASK: &str = "attention_mask";

/// Named tensors, in the order they were added, each with the examples along its first dimension.
#[derive(Debug, Default)]
pub struct Batch {
    columns: Vec<(String, Tensor)>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Batch {
        Batch::default()
    }

    /// The batch with `tensor` added as column `name`.
    pub fn with(mut self, name: impl Into<String>, tensor: Tensor) -> Batch {
        self.push(name, tensor);
        self
    }

    /// Adds `tensor` as column `name` (replacing a column of that name).
    pub fn push(&mut self, name: impl Into<String>, tensor: Tensor) {
        let name = name.into();
        match self.columns.iter_mut().find(|(n, _)| *n == name) {
            Some((_, t)) => *t = tensor,
            None => self.columns.push((name, tensor)),
        }
    }

    /// Column `name`, if the batch has it.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.columns.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// Column `name`; an error naming the columns the batch has otherwise.
    pub fn column(&self, name: &str) -> Result<&Tensor, PluginError> {
        self.get(name).ok_or_else(|| {
            PluginError::Other(format!("the batch has no column {name:?} (it has {})", self.described()))
        })
    }

    /// The labels (column [`LABEL`]).
    pub fn label(&self) -> Result<&Tensor, PluginError> {
        self.column(LABEL)
    }

    /// The model's one input: the only column besides the labels and the padding mask. A batch
    /// with several inputs is an error naming them (a model that takes several reads them by name).
    pub fn input(&self) -> Result<&Tensor, PluginError> {
        let mut inputs = self.columns.iter().filter(|(n, _)| n != LABEL && n != ATTENTION_MASK);
        match (inputs.next(), inputs.next()) {
            (Some((_, t)), None) => Ok(t),
            _ => Err(PluginError::Other(format!(
                "expected one input column besides {LABEL:?} and {ATTENTION_MASK:?}, the batch has {}",
                self.described()
            ))),
        }
    }

    /// The number of examples: the first dimension of its first column (0 when it has none).
    pub fn examples(&self) -> i64 {
        self.columns.first().and_then(|(_, t)| t.size().first().copied()).unwrap_or(0)
    }

    /// Its columns, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.columns.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The number of columns.
    pub fn len(&self) -> usize {
        self.columns.len()
    }

    /// True when it has no column.
    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// Every column passed through `f` (moved to a device, say), keeping the names.
    pub fn map<E>(&self, mut f: impl FnMut(&Tensor) -> Result<Tensor, E>) -> Result<Batch, E> {
        let columns = self.columns.iter().map(|(n, t)| Ok((n.clone(), f(t)?))).collect::<Result<_, E>>()?;
        Ok(Batch { columns })
    }

    /// A batch sharing this one's tensors.
    pub fn shallow_clone(&self) -> Batch {
        Batch { columns: self.columns.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect() }
    }

    /// `name (shape dtype), ...`, as messages show a batch.
    pub fn described(&self) -> String {
        if self.columns.is_empty() {
            return "no columns".into();
        }
        self.columns.iter().map(|(n, t)| format!("{n} {:?} {:?}", t.size(), t.kind())).collect::<Vec<_>>().join(", ")
    }
}

impl FromIterator<(String, Tensor)> for Batch {
    fn from_iter<I: IntoIterator<Item = (String, Tensor)>>(iter: I) -> Batch {
        let mut batch = Batch::new();
        for (n, t) in iter {
            batch.push(n, t);
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_input_is_the_one_column_besides_labels_and_mask() {
        let b = Batch::new()
            .with("image", Tensor::zeros([3, 2], tch::kind::FLOAT_CPU))
            .with(LABEL, Tensor::from_slice(&[1i64, 2, 3]));
        assert_eq!(b.input().unwrap().size(), [3, 2]);
        assert_eq!(b.examples(), 3);
        let lm = Batch::new()
            .with("input_ids", Tensor::zeros([2, 4], tch::kind::INT64_CPU))
            .with(ATTENTION_MASK, Tensor::ones([2, 4], tch::kind::INT64_CPU));
        assert_eq!(lm.input().unwrap().size(), [2, 4]);
        assert_eq!(
            lm.label().unwrap_err().to_string(),
            "the batch has no column \"label\" (it has input_ids [2, 4] Int64, attention_mask [2, 4] Int64)"
        );
        let two = lm.with("token_type_ids", Tensor::zeros([2, 4], tch::kind::INT64_CPU));
        assert!(two.input().unwrap_err().to_string().starts_with("expected one input column besides"));
    }
}
