//! `check` refuses what `run` refuses, with the same message, and what it prints loads again.

use std::path::{Path, PathBuf};

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

/// Runs `fencegate ARGS...` with `env` added; its exit code, stdout and stderr.
pub(crate) fn fencegate(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(BIN)
        .args(args)
        .env_remove("FENCEGATE_LOG")
        .env_remove("FENCEGATE_WORKERS")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Writes `text` as `dir/name`.
fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `check`'s exit code and stderr for a config.
fn check(path: &Path) -> (Option<i32>, String) {
    let (code, _, stderr) = fencegate(&["check", "--config", path.to_str().unwrap()], &[]);
    (code, stderr)
}

/// The `error` field of `run`'s one JSON line, and its exit code.
fn run_error(path: &Path) -> (Option<i32>, String) {
    let (code, _, stderr) = fencegate(
        &[
            "run",
            "--config",
            path.to_str().unwrap(),
            "--log-format",
            "json",
        ],
        &[],
    );
    let line: serde_json::Value = serde_json::from_str(stderr.lines().last().unwrap_or("{}"))
        .unwrap_or_else(|_| panic!("not a JSON line: {stderr}"));
    (code, line["error"].as_str().unwrap_or_default().to_owned())
}

#[test]
fn check_refuses_the_store_and_backend_urls_run_refuses() {
    let dir = tempfile::tempdir().unwrap();
    for (store, reason) in [
        (
            "{ kind: redis, url: 'redis://host/abc' }",
            "store: bad redis url: Invalid database number - InvalidClientConfig at line 2 column 8",
        ),
        (
            "{ kind: redis, url: 'rediss://host:6380/#insecure' }",
            "store: a redis url has no `#` fragment (`#insecure` would skip verifying the \
             server's certificate, which fencegate never does) at line 2 column 8",
        ),
        (
            "{ kind: postgres, url: 'postgres://host:99999/db' }",
            "store: bad postgres url: invalid connection string: invalid value for option \
             `port` at line 2 column 8",
        ),
        (
            "{ kind: etcd, url: 'etcd://' }",
            "store: etcd url names no endpoint at line 2 column 8",
        ),
    ] {
        let path = write(
            dir.path(),
            "bad.yaml",
            &format!("upstream: http://127.0.0.1:8080\nstore: {store}\n"),
        );
        let message = format!("{}: {reason}", path.display());
        assert_eq!(check(&path), (Some(1), format!("error: {message}\n")));
        assert_eq!(run_error(&path), (Some(1), message));
    }
    let path = write(
        dir.path(),
        "backend.yaml",
        "upstream: http://127.0.0.1:8080\nstore: { kind: memory }\nleases:\n  backend: { kind: redis, url: 'redis://h:6379/x' }\n  ttl: 5s\n",
    );
    let message = format!(
        "{}: leases.backend: bad redis url: Invalid database number - InvalidClientConfig at \
         line 4 column 12",
        path.display()
    );
    assert_eq!(check(&path), (Some(1), format!("error: {message}\n")));
    assert_eq!(run_error(&path), (Some(1), message));
}

/// What `check` prints after its `#` lines loads again as the same config, for urls with a
/// password (printed `****`) and without one (printed as written).
#[test]
fn check_output_loads_again_with_and_without_passwords() {
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "postgres://postgres@127.0.0.1:5432/fences",
        "postgres://postgres:secret@127.0.0.1:5432/fences",
        "redis://127.0.0.1:6379/0",
        "redis://app:secret@127.0.0.1:6379/0",
    ] {
        let kind = &url[..url.find(':').unwrap()];
        let first = write(
            dir.path(),
            "first.yaml",
            &format!("upstream: http://127.0.0.1:8080\nstore: {{ kind: {kind}, url: '{url}' }}\n"),
        );
        let (code, printed, stderr) =
            fencegate(&["check", "--config", first.to_str().unwrap()], &[]);
        assert_eq!((code, stderr.as_str()), (Some(0), ""), "{printed}");
        let shown = url.replace(":secret@", ":****@");
        assert!(printed.contains(&format!("  url: {shown}\n")), "{printed}");
        let second = write(dir.path(), "second.yaml", &printed);
        let (code, again, stderr) =
            fencegate(&["check", "--config", second.to_str().unwrap()], &[]);
        assert_eq!((code, stderr.as_str()), (Some(0), ""), "{again}");
        assert_eq!(
            again,
            printed.replacen(
                &first.display().to_string(),
                &second.display().to_string(),
                1
            )
        );
    }
}

/// A TLS file that cannot be read is named with its field, `tls.key`, by `check` and `run`.
#[test]
fn a_missing_tls_key_is_named_with_its_field() {
    let dir = tempfile::tempdir().unwrap();
    let cert = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/server.pem");
    let missing = dir.path().join("missing-key.pem");
    let path = write(
        dir.path(),
        "tls.yaml",
        &format!(
            "upstream: http://127.0.0.1:8080\nstore: {{ kind: memory }}\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\ntls: {{ cert: {}, key: {} }}\n",
            cert.display(),
            missing.display()
        ),
    );
    let reason = format!(
        "tls.key: cannot read a private key from {}: I/O error: No such file or directory (os \
         error 2)",
        missing.display()
    );
    assert_eq!(
        check(&path),
        (Some(1), format!("error: {}: {reason}\n", path.display()))
    );
    assert_eq!(run_error(&path), (Some(1), reason));
}

/// The misspelt field and the duplicate one, as `check` prints them.
#[test]
fn check_suggests_a_field_and_places_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "typo.yaml", "upstrem: http://127.0.0.1:8080\n");
    let (code, stderr) = check(&path);
    assert_eq!(code, Some(1));
    assert!(
        stderr.ends_with("`log` at line 1 column 1; did you mean `upstream`?\n"),
        "{stderr}"
    );
    let path = write(
        dir.path(),
        "twice.yaml",
        "upstream: http://127.0.0.1:8080\nroutes: []\nroutes: []\n",
    );
    assert_eq!(
        check(&path),
        (
            Some(1),
            format!(
                "error: {}: duplicate field `routes` at line 3 column 1\n",
                path.display()
            )
        )
    );
}

/// `FENCEGATE_WORKERS` and `FENCEGATE_LOG` that cannot be used stop `run` before it starts,
/// saying why, instead of being ignored.
#[test]
fn unusable_environment_variables_stop_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "ok.yaml",
        "upstream: http://127.0.0.1:8080\nstore: { kind: memory }\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\n",
    );
    let run = |env: &[(&str, &str)]| {
        let (code, _, stderr) = fencegate(&["run", "--config", path.to_str().unwrap()], env);
        (code, stderr)
    };
    assert_eq!(
        run(&[("FENCEGATE_WORKERS", "two")]),
        (
            Some(1),
            "error: FENCEGATE_WORKERS=`two`: the number of runtime worker threads is a whole \
             number, 1 or more\n"
                .to_owned()
        )
    );
    assert_eq!(
        run(&[("FENCEGATE_WORKERS", "0")]).1,
        "error: FENCEGATE_WORKERS=`0`: the number of runtime worker threads is a whole number, \
         1 or more\n"
    );
    assert_eq!(
        run(&[("FENCEGATE_LOG", "info,hyper=verbose")]),
        (
            Some(1),
            "error: FENCEGATE_LOG=`info,hyper=verbose`: not a log filter (error parsing level \
             filter: expected one of \"off\", \"error\", \"warn\", \"info\", \"debug\", \
             \"trace\", or a number 0-5); write one like `warn` or `info,hyper=debug`\n"
                .to_owned()
        )
    );
}

/// `inject --config` refuses a sidecar config the pod's Service or probes could not reach.
#[test]
fn inject_refuses_a_loopback_listener() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        dir.path(),
        "sidecar.yaml",
        "upstream: http://127.0.0.1:8080\nstore: { kind: memory }\nlisten: 127.0.0.1:7440\n",
    );
    let manifest = write(
        dir.path(),
        "pod.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata: { name: p }\nspec:\n  containers: [{ name: app, image: app }]\n",
    );
    let (code, stdout, stderr) = fencegate(
        &[
            "inject",
            "--config",
            config.to_str().unwrap(),
            "-f",
            manifest.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!((code, stdout.as_str()), (Some(1), ""));
    assert_eq!(
        stderr,
        format!(
            "error: {}: `listen: 127.0.0.1:7440`: a loopback address is reached from inside the \
             pod only: the Service's traffic would never arrive; the injected sidecar serves \
             `listen` on port 7440 and `admin` on port 7441 of every address (`0.0.0.0:7440`), \
             where the Service and the probes reach them\n",
            config.display()
        )
    );
}

/// The `ttl` and `webhook` command lines say what each flag is: a zero `--round-to` is
/// refused naming the flag (not the field it fills), `ttl --help` describes every flag, and
/// `help webhook` describes its own `--config`, not `inject`'s.
#[test]
fn the_ttl_and_webhook_command_lines_explain_their_flags() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(BIN).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (code, _, err) = run(&[
        "ttl",
        "--p99-work",
        "800ms",
        "--p99-rtt",
        "40ms",
        "--round-to",
        "0s",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("invalid value '0s' for '--round-to <ROUND_TO>': must be greater than zero"),
        "{err}"
    );

    let (code, help, _) = run(&["ttl", "--help"]);
    assert_eq!(code, Some(0));
    // Every flag line is followed by its description on the same line or the next.
    let flags: Vec<&str> = help
        .lines()
        .filter(|l| l.trim_start().starts_with("--"))
        .collect();
    assert!(flags.len() >= 5, "{help}");
    for line in &flags {
        let described = line
            .trim_start()
            .split_once("  ")
            .is_some_and(|(_, d)| !d.trim().is_empty());
        assert!(described, "no description: {line}\n{help}");
    }

    let (_, webhook, _) = run(&["help", "webhook"]);
    let (_, inject, _) = run(&["help", "inject"]);
    assert!(webhook.contains("not written anywhere"), "{webhook}");
    assert!(!inject.contains("not written anywhere"), "{inject}");
}

/// The fields fencegate accepts in the config section `path` (`""` for the top level), as
/// its own error for an unknown one lists them.
fn accepted_fields(path: &str) -> Vec<String> {
    let yaml = match path {
        "" => "upstream: http://127.0.0.1:1\nzzz_unknown: 1\n".to_owned(),
        "routes" => "upstream: http://127.0.0.1:1\nroutes:\n  - { name: a, path: /a, zzz_unknown: 1 }\n"
            .to_owned(),
        "store" => {
            "upstream: http://127.0.0.1:1\nstore: { kind: redis, url: 'redis://x/', zzz_unknown: 1 }\n"
                .to_owned()
        }
        section => format!("upstream: http://127.0.0.1:1\n{section}: {{ zzz_unknown: 1 }}\n"),
    };
    let err = fencegate::config::Config::parse(&yaml)
        .unwrap_err()
        .to_string();
    let list = err
        .split("unknown field `zzz_unknown`, expected ")
        .nth(1)
        .unwrap_or_else(|| panic!("{path}: {err}"));
    let list = list.split(" at line").next().unwrap();
    let mut fields: Vec<String> = list
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    fields.sort();
    fields
}

/// The chart's `values.schema.json` describes `sidecarConfig` with exactly the fields
/// fencegate accepts, each section closed (`additionalProperties: false`): a misspelt key is
/// refused at `helm install` (.ci/k8s renders three), and a field fencegate gains or loses
/// without the schema following fails here.
#[test]
fn the_charts_sidecar_config_schema_names_exactly_the_fields_fencegate_accepts() {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/charts/fencegate/values.schema.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let top = &schema["properties"]["sidecarConfig"];
    let closed = |node: &serde_json::Value, what: &str| {
        assert_eq!(node["additionalProperties"], false, "{what} is not closed");
        let mut keys: Vec<String> = node["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("{what} has no properties"))
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(closed(top, "sidecarConfig"), accepted_fields(""));
    assert_eq!(
        closed(&top["properties"]["routes"]["items"], "routes[]"),
        accepted_fields("routes")
    );
    for section in SECTIONS {
        assert_eq!(
            closed(&top["properties"][section], section),
            accepted_fields(section),
            "{section}"
        );
    }
}

/// The config's sections that are mappings of fields.
const SECTIONS: [&str; 10] = [
    "token",
    "store",
    "fence",
    "timeouts",
    "limits",
    "log",
    "idempotency",
    "tls",
    "egress",
    "leases",
];

/// config/fencegate.yaml, the annotated example, names every field fencegate accepts at the
/// top level, in each section and in a route (set or commented out), as fencegate's own
/// unknown-field error lists them: a new field without a line there fails here.
#[test]
fn the_annotated_example_names_every_field_fencegate_accepts() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/fencegate.yaml"
    ))
    .unwrap();
    let named = |field: &str| {
        text.lines().any(|l| {
            let l = l.trim_start().trim_start_matches('#').trim_start();
            let l = l.strip_prefix("- ").unwrap_or(l).trim_start_matches("{ ");
            l.starts_with(&format!("{field}:")) || l.contains(&format!(" {field}:"))
        })
    };
    for section in ["", "routes"].into_iter().chain(SECTIONS) {
        for field in accepted_fields(section) {
            assert!(
                named(&field),
                "config/fencegate.yaml never names {section}.{field}"
            );
        }
    }
}
