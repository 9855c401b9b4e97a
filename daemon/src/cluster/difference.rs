//! How two run configurations differ, said the way a refused join tells it: the first key
//! (dotted into nested objects) whose values differ, with both values.

/// `key = theirs on WHO, ours` for the first differing key of two JSON objects.
pub(crate) fn json_difference(theirs: &str, ours: &str, who: &str) -> String {
    let parse = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap_or_default();
    match first_difference("", &parse(theirs), &parse(ours)) {
        Some((key, x, y)) => {
            let show = |v: Option<&serde_json::Value>| v.map_or("(absent)".to_string(), |v| v.to_string());
            format!("{key} = {} on {who}, {}", show(x), show(y))
        }
        None => format!("{theirs} on {who}, {ours}"),
    }
}

/// The first key (dotted into objects present on both sides: `plugin.identity.module_sha256`) at
/// which two run configurations differ, with both values.
fn first_difference<'a>(
    prefix: &str,
    a: &'a serde_json::Value,
    b: &'a serde_json::Value,
) -> Option<(String, Option<&'a serde_json::Value>, Option<&'a serde_json::Value>)> {
    let (serde_json::Value::Object(a), serde_json::Value::Object(b)) = (a, b) else {
        return (a != b).then(|| (prefix.to_string(), Some(a), Some(b)));
    };
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter().find_map(|key| {
        let dotted = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match (a.get(key), b.get(key)) {
            (Some(x), Some(y)) => first_difference(&dotted, x, y),
            (x, y) => (x != y).then_some((dotted, x, y)),
        }
    })
}
