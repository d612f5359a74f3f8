//! YAML in and out the way Kubernetes reads it.
//!
//! kubectl and the API server read YAML 1.1 (go-yaml v2): a plain `0644` is the octal number
//! 420, a plain `yes` or `on` is `true`, a plain `1_000` is 1000. serde_yaml reads YAML 1.2,
//! where all three are strings, so re-serialising its reading would quietly turn
//! `defaultMode: 0644` into `defaultMode: "0644"`, which the API server refuses. [`load`] therefore
//! re-reads the plain scalars that YAML 1.2 left as strings with the YAML 1.1 rules, and
//! [`emit`] writes only forms that both versions read the same way (strings that could be
//! anything else are double-quoted).

mod emit;
mod load;

pub use emit::emit;
pub use load::load;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_scalars_are_read_as_kubernetes_reads_them() {
        let v = load(
            "a: 0644\nb: '0644'\nc: yes\nd: \"on\"\ne: 1_000\nf: 09\ng: 1.0\nh: 0o17\ni: x_1\n",
        )
        .unwrap();
        assert_eq!(
            v,
            json!({"a": 420, "b": "0644", "c": true, "d": "on", "e": 1000, "f": 9, "g": 1, "h": 15, "i": "x_1"})
        );
    }

    #[test]
    fn merge_keys_and_anchors() {
        let v = load("base: &b {x: 1, y: 2}\nm:\n  <<: *b\n  y: 3\n").unwrap();
        assert_eq!(v["m"], json!({"x": 1, "y": 3}));
        assert!(load("a: 1\na: 2\n").is_err());
    }

    #[test]
    fn emitted_yaml_reads_back_identically() {
        let v = json!({
            "plain": "nginx:1.25", "path": "/etc/x", "ambiguous": ["--config", "-v", "---x", "- x", "-1", "--1", "yes", "No", "0644", "1.0", "8080",
            "50m", "", " lead", "trail ", "a: b", "a #b", "~", "null", "-x", "[x]", "{y}", "*z", "&a",
            "!t", "%p", "@a", "`b", "x\ty", "é", "\u{2028}", "\r\n", "q\"uote", "back\\slash"],
            "blocks": ["line1\nline2\n", "no newline\nat end", "kept\n\n\n", "  indented\nfirst\n",
                       "\nleading blank\n", "a\n  b\n\n  c\n"],
            "nested": [[1, 2], [], {}, {"k": [{"a": null}]}], "num": 1.5, "neg": -3, "t": true,
            "8080": "numeric key", "yes": "bool key"
        });
        let text = emit(&v);
        assert_eq!(load(&text).unwrap(), v, "{text}");
    }
}
