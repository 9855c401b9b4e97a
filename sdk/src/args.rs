//! Plugin configuration: the keys a plugin accepts ([`ArgSpec`]) and the `KEY=VALUE` pairs an
//! operator gives (`--plugin-arg`, [`PluginArgs`]), checked against them before the plugin sees
//! them, so that an unknown key is refused the same way by every plugin.
//!
//! Values stay strings here; a plugin reads them with [`PluginArgs::parsed`] or its own parser,
//! and refuses a bad value with a message naming the key and what it accepts.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::PluginError;

/// One key a plugin accepts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArgSpec {
    /// The key, as in `--plugin-arg KEY=VALUE`.
    pub key: String,
    /// What it accepts, in a few words (`plugin check` lists it).
    pub help: String,
    /// The value used when the key is not given; `None` when there is none (the plugin requires
    /// it, or derives its default from other keys, which `help` then says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// Whether every worker must give the same value, checked at admission and on resume. False
    /// for a value whose meaning the plugin states otherwise: a path, whose file's sha256 the
    /// plugin puts in [`crate::PluginInfo::identity`], may differ from node to node.
    pub agreed: bool,
}

/// The key of [`ArgSpec::others`].
pub const OTHER_KEYS: &str = "*";

impl ArgSpec {
    /// Any key besides the others, checked by the plugin itself once [`crate::Model::info`] has
    /// the arguments (a Python model plugin: the keys its model file declares). What makes the
    /// model the one it is, among them, belongs in [`crate::PluginInfo::identity`].
    pub fn others(help: &str) -> ArgSpec {
        ArgSpec { key: OTHER_KEYS.into(), help: help.into(), default: None, agreed: false }
    }

    /// A key every worker must give the same value for.
    pub fn new(key: &str, help: &str, default: Option<&str>) -> ArgSpec {
        ArgSpec { key: key.into(), help: help.into(), default: default.map(Into::into), agreed: true }
    }

    /// A key whose value may differ between workers (see [`ArgSpec::agreed`]).
    pub fn local(mut self) -> ArgSpec {
        self.agreed = false;
        self
    }
}

/// `--plugin-arg` items that are not arguments of the plugin's.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// An item without `=`.
    #[error("--plugin-arg {item:?}: expected KEY=VALUE")]
    Form {
        /// The item.
        item: String,
    },
    /// An item with an empty key.
    #[error("--plugin-arg {item:?}: the key is empty (expected KEY=VALUE)")]
    EmptyKey {
        /// The item.
        item: String,
    },
    /// A key given twice.
    #[error("--plugin-arg {key} is given twice ({first:?} and {second:?})")]
    Twice {
        /// The key.
        key: String,
        /// Its first value.
        first: String,
        /// Its second.
        second: String,
    },
    /// A key the plugin does not take.
    #[error("--plugin-arg {key}: no such key; {accepted}")]
    NoSuchKey {
        /// The key.
        key: String,
        /// The keys it takes, as [`accepted`] says them.
        accepted: String,
    },
}

/// The `--plugin-arg KEY=VALUE` pairs of a run, by key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PluginArgs(BTreeMap<String, String>);

impl PluginArgs {
    /// Parses `KEY=VALUE` items; a key given twice, an item without `=` or an empty key is an
    /// error naming the item.
    pub fn parse<S: AsRef<str>>(items: &[S]) -> Result<PluginArgs, ArgError> {
        let mut map = BTreeMap::new();
        for item in items {
            let item = item.as_ref();
            let Some((key, value)) = item.split_once('=') else {
                return Err(ArgError::Form { item: item.into() });
            };
            let key = key.trim();
            if key.is_empty() {
                return Err(ArgError::EmptyKey { item: item.into() });
            }
            if let Some(first) = map.insert(key.to_string(), value.to_string()) {
                return Err(ArgError::Twice { key: key.into(), first, second: value.into() });
            }
        }
        Ok(PluginArgs(map))
    }

    /// The value of `key`, if given.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// The value of `key` parsed as a `T`, if given; a value that does not parse is an error
    /// naming the key, the value and `expected` (what the key accepts).
    pub fn parsed<T: FromStr>(&self, key: &str, expected: &str) -> Result<Option<T>, PluginError> {
        self.get(key)
            .map(|v| {
                v.trim().parse().map_err(|_| PluginError::Other(format!("--plugin-arg {key}={v}: expected {expected}")))
            })
            .transpose()
    }

    /// Whether no argument is given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pairs, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Refuses a key that `specs` does not name, listing the keys accepted.
    pub fn check(&self, specs: &[ArgSpec]) -> Result<(), ArgError> {
        if specs.iter().any(|s| s.key == OTHER_KEYS) {
            return Ok(());
        }
        match self.0.keys().find(|k| !specs.iter().any(|s| &s.key == *k)) {
            None => Ok(()),
            Some(key) => Err(ArgError::NoSuchKey { key: key.clone(), accepted: accepted(specs) }),
        }
    }

    /// The values of the keys `specs` marks [`ArgSpec::agreed`], given or else their defaults:
    /// what every worker must have alike (a worker that gives a default and one that leaves it
    /// out agree).
    pub fn agreed(&self, specs: &[ArgSpec]) -> PluginArgs {
        PluginArgs(
            specs
                .iter()
                .filter(|s| s.agreed)
                .filter_map(|s| Some((s.key.clone(), self.0.get(&s.key).or(s.default.as_ref())?.clone())))
                .collect(),
        )
    }
}

/// The keys of `specs` as one phrase: "it accepts loss, module", or "it takes no --plugin-arg".
pub fn accepted(specs: &[ArgSpec]) -> String {
    if specs.is_empty() {
        return "it takes no --plugin-arg".into();
    }
    let keys: Vec<&str> = specs.iter().map(|s| s.key.as_str()).collect();
    format!("it accepts {}", keys.join(", "))
}

/// One line per key of `specs`: `KEY: HELP (default D)`, or `KEY: HELP` when it has no default.
pub fn describe(specs: &[ArgSpec]) -> Vec<String> {
    specs
        .iter()
        .map(|s| match &s.default {
            Some(d) => format!("{}: {} (default {d})", s.key, s.help),
            None => format!("{}: {}", s.key, s.help),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<ArgSpec> {
        vec![
            ArgSpec::new("loss", "cross_entropy or mse", Some("cross_entropy")),
            ArgSpec::new("module", "a path", None).local(),
        ]
    }

    #[test]
    fn parses_pairs_and_keeps_equals_signs_in_values() {
        let args = PluginArgs::parse(&["module=/a/b=c.pt", "loss=mse"]).unwrap();
        assert_eq!(args.get("module"), Some("/a/b=c.pt"));
        assert_eq!(args.iter().collect::<Vec<_>>(), [("loss", "mse"), ("module", "/a/b=c.pt")]);
    }

    #[test]
    fn refuses_malformed_items_naming_them() {
        assert_eq!(
            PluginArgs::parse(&["module"]).unwrap_err().to_string(),
            "--plugin-arg \"module\": expected KEY=VALUE"
        );
        assert_eq!(
            PluginArgs::parse(&["=x"]).unwrap_err().to_string(),
            "--plugin-arg \"=x\": the key is empty (expected KEY=VALUE)"
        );
        assert_eq!(
            PluginArgs::parse(&["loss=mse", "loss=ce"]).unwrap_err().to_string(),
            "--plugin-arg loss is given twice (\"mse\" and \"ce\")"
        );
    }

    #[test]
    fn unknown_keys_are_refused_with_the_accepted_ones() {
        let args = PluginArgs::parse(&["los=mse"]).unwrap();
        assert_eq!(
            args.check(&specs()).unwrap_err().to_string(),
            "--plugin-arg los: no such key; it accepts loss, module"
        );
        assert_eq!(args.check(&[]).unwrap_err().to_string(), "--plugin-arg los: no such key; it takes no --plugin-arg");
        assert!(PluginArgs::parse(&["loss=mse"]).unwrap().check(&specs()).is_ok());
        let open = [ArgSpec::new("module", "a path", None), ArgSpec::others("the file's keys")];
        assert!(args.check(&open).is_ok(), "the plugin checks the other keys itself");
        assert!(args.agreed(&open).get("los").is_none());
    }

    #[test]
    fn bad_values_name_the_key_and_what_it_accepts() {
        let args = PluginArgs::parse(&["classes=ten"]).unwrap();
        let err = args.parsed::<u32>("classes", "a whole number of classes").unwrap_err();
        assert_eq!(err.to_string(), "--plugin-arg classes=ten: expected a whole number of classes");
        assert_eq!(PluginArgs::default().parsed::<u32>("classes", "").unwrap(), None);
    }

    #[test]
    fn only_agreed_keys_are_agreed_with_their_defaults() {
        let args = PluginArgs::parse(&["module=/x.pt", "loss=mse"]).unwrap();
        assert_eq!(args.agreed(&specs()), PluginArgs::parse(&["loss=mse"]).unwrap());
        let default = PluginArgs::parse(&["module=/x.pt"]).unwrap();
        assert_eq!(default.agreed(&specs()), PluginArgs::parse(&["loss=cross_entropy"]).unwrap());
    }
}
