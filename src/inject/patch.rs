//! RFC 6902 JSON Patch between a pod and its injected form, for the webhook's answer.
//!
//! The API server applies the patch to the pod it sent, so the ops must not assume more than
//! what changed: new keys are `add`ed, items added at the end of a list are `add`ed at `/-`,
//! items added at its front at `/0`, `/1`, ...; items changed in place are diffed in place;
//! anything else is a `replace` of the smallest enclosing value that differs.

use serde_json::{json, Value};

/// The ops that turn `old` into `new`.
pub fn diff(old: &Value, new: &Value) -> Vec<Value> {
    let mut ops = Vec::new();
    diff_at(&mut String::new(), old, new, &mut ops);
    ops
}

fn diff_at(path: &mut String, old: &Value, new: &Value, ops: &mut Vec<Value>) {
    if old == new {
        return;
    }
    match (old, new) {
        (Value::Object(before), Value::Object(after)) => {
            for (key, value) in after {
                let len = path.len();
                push_token(path, key);
                match before.get(key) {
                    Some(previous) => diff_at(path, previous, value, ops),
                    None => ops.push(json!({"op": "add", "path": path, "value": value})),
                }
                path.truncate(len);
            }
            for key in before.keys().filter(|k| !after.contains_key(*k)) {
                let len = path.len();
                push_token(path, key);
                ops.push(json!({"op": "remove", "path": path}));
                path.truncate(len);
            }
        }
        (Value::Array(before), Value::Array(after))
            if after.len() > before.len() && after.ends_with(before) =>
        {
            let added = after.len() - before.len();
            for (i, value) in after[..added].iter().enumerate() {
                ops.push(json!({"op": "add", "path": format!("{path}/{i}"), "value": value}));
            }
        }
        // Items changed in place (an app container given variables), then any added at the end.
        (Value::Array(before), Value::Array(after)) if after.len() >= before.len() => {
            for (i, (previous, value)) in before.iter().zip(after).enumerate() {
                let len = path.len();
                path.push_str(&format!("/{i}"));
                diff_at(path, previous, value, ops);
                path.truncate(len);
            }
            for value in &after[before.len()..] {
                ops.push(json!({"op": "add", "path": format!("{path}/-"), "value": value}));
            }
        }
        _ => ops.push(json!({"op": "replace", "path": path, "value": new})),
    }
}

/// Appends `/token` with RFC 6901 escaping (`~` as `~0`, `/` as `~1`).
fn push_token(path: &mut String, token: &str) {
    path.push('/');
    path.push_str(&token.replace('~', "~0").replace('/', "~1"));
}
