use super::*;

#[test]
fn store_urls_never_print_their_password() {
    let c = Config::parse(
        "upstream: http://a:1\nstore: { kind: postgres, url: 'postgres://app:s3cret@db:5432/fences' }\n",
    )
    .unwrap();
    let url = &c.store.remote().unwrap().url;
    assert_eq!(url.expose(), "postgres://app:s3cret@db:5432/fences");
    assert_eq!(url.to_string(), "postgres://app:****@db:5432/fences");
    assert_eq!(format!("{url:?}"), "postgres://app:****@db:5432/fences");
    assert!(!c.to_yaml().contains("s3cret"));
    assert!(!format!("{c:?}").contains("s3cret"));
    let plain = SecretUrl::try_from("redis://127.0.0.1:6379/".to_owned()).unwrap();
    assert_eq!(plain.to_string(), "redis://127.0.0.1:6379/");
    let query =
        SecretUrl::try_from("postgres://db/x?user=a&password=pw&sslmode=disable".to_owned())
            .unwrap();
    assert_eq!(
        query.to_string(),
        "postgres://db/x?user=a&password=****&sslmode=disable"
    );
    let token_only = SecretUrl::try_from("redis://:pw@h/".to_owned()).unwrap();
    assert_eq!(token_only.to_string(), "redis://:****@h/");
    // Passwords with `/`, `?` or `#` unencoded (as `openssl rand -base64` makes them): the
    // etcd and PostgreSQL URL readers take them, so they must be masked too.
    for (raw, shown) in [
        (
            "https://fencegate:ab/Cd+9=@etcd-0:2379,etcd-1:2379",
            "https://fencegate:****@etcd-0:2379,etcd-1:2379",
        ),
        (
            "postgres://app:x/y@db/fences",
            "postgres://app:****@db/fences",
        ),
        ("etcd://u:pa?ss@h:2379", "etcd://u:****@h:2379"),
        ("redis://u:p#w@h:6379/0", "redis://u:****@h:6379/0"),
        (
            "postgres://app:p/w?x@db/f?sslmode=require&password=q",
            "postgres://app:****@db/f?sslmode=require&password=****",
        ),
    ] {
        let url = SecretUrl::try_from(raw.to_owned()).unwrap();
        assert_eq!(url.to_string(), shown, "{raw}");
    }
}

#[test]
fn store_tls_prints_back_and_loads_again() {
    let c = Config::parse(
        "upstream: http://a:1\n\
         store: { kind: redis, url: 'rediss://app:pw@r:6380/0', tls: { ca: /etc/ca.pem, cert: /c.pem, key: /k.pem, server_name: redis.internal } }\n\
         leases: { backend: { kind: etcd, url: 'https://e:2379', tls: { ca: /etc/ca.pem } }, ttl: 1s }\n",
    )
    .unwrap();
    let tls = c.store.remote().unwrap().tls.as_ref().unwrap();
    assert_eq!(tls.server_name.as_deref(), Some("redis.internal"));
    assert_eq!(tls.key.as_deref(), Some(Path::new("/k.pem")));
    let yaml = c.to_yaml();
    assert!(yaml.contains("rediss://app:****@r:6380/0"), "{yaml}");
    assert!(!yaml.contains("pw"), "{yaml}");
    let again = Config::parse(&yaml).unwrap();
    let tls = |store: &StoreConfig| store.remote().unwrap().tls.clone();
    assert_eq!(tls(&again.store), tls(&c.store));
    let tls = |leases: Option<LeasesConfig>| leases.unwrap().backend.remote().unwrap().tls.clone();
    assert_eq!(tls(again.leases), tls(c.leases));
}

/// Each kind prints the fields it uses (a memory store has none but its kind), and what it
/// prints loads again as the same store.
#[test]
fn each_store_kind_prints_the_fields_it_uses() {
    for (store, printed) in [
        (
            "{ kind: memory, prefix: app, cache_size: 3 }",
            "store:\n  kind: memory\nfence:",
        ),
        (
            "{ kind: embedded, path: /tmp/f.db, cache_size: 5 }",
            "store:\n  kind: embedded\n  path: /tmp/f.db\n  prefix: fencegate\n  cache_size: 5\nfence:",
        ),
        (
            "{ kind: postgres, url: 'postgres://db/x', prefix: app }",
            "store:\n  kind: postgres\n  url: postgres://db/x\n  prefix: app\n  cache_size: 100000\nfence:",
        ),
    ] {
        let c = Config::parse(&format!("upstream: http://a:1\nstore: {store}\n")).unwrap();
        let yaml = c.to_yaml();
        assert!(yaml.contains(printed), "{store}:\n{yaml}");
        assert_eq!(Config::parse(&yaml).unwrap().store, c.store);
    }
}

/// The store's prefix and the lease backend's are checked by the same rule, with the same
/// words.
#[test]
fn store_and_lease_backend_prefixes_are_checked_alike() {
    let rule = "`prefix` `1x` must be 1-40 letters, digits or `_`, not starting with a digit";
    assert_eq!(
        err("upstream: http://a:1\nstore: { kind: embedded, prefix: 1x }\n"),
        format!("store: {rule} at line 2 column 8")
    );
    assert_eq!(
        err("upstream: http://a:1\nleases: { backend: { kind: embedded, prefix: 1x }, ttl: 1s }\n"),
        format!("leases.backend: {rule} at line 2 column 20")
    );
}

#[test]
fn replicas_is_for_postgres_and_prints_back() {
    let c = Config::parse(
        "upstream: http://a:1\n\
         store: { kind: postgres, url: 'postgres://app@db1,db2/f?target_session_attrs=read-write', replicas: 1 }\n\
         leases: { backend: { kind: postgres, url: 'postgres://app@db1/f', replicas: 0 }, ttl: 1s }\n",
    )
    .unwrap();
    assert_eq!(c.store.remote().unwrap().replicas, Some(1));
    let leases = c.leases.as_ref().unwrap();
    assert_eq!(leases.backend.remote().unwrap().replicas, Some(0));
    let yaml = c.to_yaml();
    assert!(
        yaml.contains("replicas: 1") && yaml.contains("replicas: 0"),
        "{yaml}"
    );
    let again = Config::parse(&yaml).unwrap();
    assert_eq!(again.store.remote().unwrap().replicas, Some(1));
    let unset =
        Config::parse("upstream: http://a:1\nstore: { kind: postgres, url: 'postgres://db/f' }\n")
            .unwrap();
    assert_eq!(unset.store.remote().unwrap().replicas, None);
    assert!(!unset.to_yaml().contains("replicas"));
    for store in [
        "{ kind: redis, url: 'redis://r/', replicas: 1 }",
        "{ kind: etcd, url: 'etcd://e:2379', replicas: 1 }",
        "{ kind: embedded, replicas: 1 }",
        "{ kind: memory, replicas: 0 }",
    ] {
        let e = Config::parse(&format!("upstream: http://a:1\nstore: {store}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`replicas` is for the postgres store"),
            "{store}: {e}"
        );
    }
    let e = Config::parse(
        "upstream: http://a:1\nleases: { backend: { kind: etcd, url: 'etcd://e:2379', replicas: 1 }, ttl: 1s }\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`replicas` is for the postgres backend"), "{e}");
}
