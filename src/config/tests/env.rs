use super::*;

#[test]
fn environment_variables_expand_in_config_files() {
    let env = |name: &str| match name {
        "FENCEGATE_UPSTREAM_PORT" => Some("9090".to_owned()),
        "PG_PASSWORD" => Some("s3cret".to_owned()),
        _ => None,
    };
    let text = "upstream: http://127.0.0.1:${FENCEGATE_UPSTREAM_PORT:-8080}\n\
                store: { kind: postgres, url: 'postgres://app:${PG_PASSWORD}@db/x' }\n\
                admin: 0.0.0.0:${ADMIN_PORT:-7441}\n";
    let expanded = expand_env(text, env).unwrap();
    assert!(expanded.contains("127.0.0.1:9090"), "{expanded}");
    assert!(expanded.contains("app:s3cret@db"), "{expanded}");
    assert!(expanded.contains("0.0.0.0:7441"), "{expanded}");
    let c = Config::parse(&expanded).unwrap();
    assert_eq!(c.upstream.unwrap().to_string(), "http://127.0.0.1:9090");
    let e = expand_env("upstream: x\nlisten: ${MISSING}\n", env).unwrap_err();
    assert_eq!(
        e,
        EnvError::Unset {
            line: 2,
            name: "MISSING".into()
        }
    );
    assert_eq!(
        e.to_string(),
        "line 2: environment variable MISSING is not set (write ${MISSING:-default} for a default)"
    );
    assert_eq!(
        expand_env("a: ${lower}", env).unwrap_err().to_string(),
        "line 1: `${lower}`: environment variable names are A-Z, 0-9 and _"
    );
    assert_eq!(
        expand_env("a: ${OPEN", env).unwrap_err().to_string(),
        "line 1: `${` without a closing `}`"
    );
    assert_eq!(
        expand_env("no variables: {id}", env).unwrap(),
        "no variables: {id}"
    );
}
