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
        "{ kind: etcd, url: 'etcd://e:2379', replicas: 1 }",
        "{ kind: embedded, replicas: 1 }",
        "{ kind: memory, replicas: 0 }",
    ] {
        let e = Config::parse(&format!("upstream: http://a:1\nstore: {store}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`replicas` is for the redis and postgres stores"),
            "{store}: {e}"
        );
    }
    let e = Config::parse(
        "upstream: http://a:1\nleases: { backend: { kind: etcd, url: 'etcd://e:2379', replicas: 1 }, ttl: 1s }\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`replicas` is for the redis and postgres backends"),
        "{e}"
    );
}

#[test]
fn redis_sentinel_and_replicas() {
    let c = Config::parse(
        "upstream: http://a:1\n\
         store:\n  kind: redis\n  url: 'rediss://app:pw@mymaster/2'\n  tls: { ca: /etc/ca.pem }\n  \
         sentinel: { master: mymaster, urls: ['rediss://:spw@s1:26379', 'rediss://s2:26379'] }\n\
         leases: { backend: { kind: redis, url: 'redis://mymaster/', sentinel: { master: mymaster, urls: ['redis://s1:26379'] }, replicas: 0 }, ttl: 1s }\n",
    )
    .unwrap();
    let remote = c.store.remote().unwrap();
    let sentinel = remote.redis.sentinel.as_ref().unwrap();
    assert_eq!(sentinel.master, "mymaster");
    assert_eq!(sentinel.urls[0].expose(), "rediss://:spw@s1:26379");
    // With Sentinel a write waits for one replica unless told otherwise.
    assert_eq!(remote.redis.replicas, 1);
    let backend = c.leases.as_ref().unwrap().backend.remote().unwrap();
    assert_eq!(backend.redis.replicas, 0);
    // Printed with the Sentinel passwords masked, and read back the same.
    let yaml = c.to_yaml();
    assert!(!yaml.contains("spw"), "{yaml}");
    assert!(yaml.contains("replicas: 1"), "{yaml}");
    // A lone server waits for none.
    let lone =
        Config::parse("upstream: http://a:1\nstore: { kind: redis, url: 'redis://r:6379/' }\n")
            .unwrap();
    assert_eq!(lone.store.remote().unwrap().redis.replicas, 0);

    for (yaml, wanted) in [
        (
            "store: { kind: redis, url: 'redis://10.0.0.5:6379/', sentinel: { master: mymaster, urls: ['redis://s:26379'] } }",
            "store: with `sentinel`, the `url` gives the data nodes' user, password and database, and names the master instead of a server: write `redis://user:password@mymaster/0` (its host is `10.0.0.5:6379`, which would never be dialled) at line 2",
        ),
        (
            "store: { kind: redis, url: 'redis://m/', sentinel: { master: m, urls: [] } }",
            "store: `sentinel.urls` lists at least one Sentinel",
        ),
        (
            "store: { kind: redis, url: 'redis://m/', sentinel: { master: m, urls: ['http://s:26379'] } }",
            "store: `sentinel.urls[0]`: the `url` does not fit kind redis",
        ),
        (
            "store: { kind: redis, url: 'rediss://m/', sentinel: { master: m, urls: ['rediss://s:1', 'redis://s:2'] } }",
            "store: `sentinel.urls[1]` and `url` differ in scheme",
        ),
        (
            "store: { kind: redis, url: 'redis://m/', sentinel: { master: m, urls: ['redis://s:1/3'] } }",
            "store: `sentinel.urls[0]` names a database",
        ),
        (
            "store: { kind: redis, url: 'redis://m/', sentinel: { master: m, urls: ['redis://s:1'], quorum: 2 } }",
            "store.sentinel: unknown field `quorum`",
        ),
        (
            "store: { kind: etcd, url: 'etcd://e:2379', replicas: 1 }",
            "store: `replicas` is for the redis and postgres stores",
        ),
        (
            "store: { kind: embedded, sentinel: { master: m, urls: ['redis://s:1'] } }",
            "store: `sentinel` is for the redis store",
        ),
        (
            "store: { kind: redis, url: 'redis://r/', replicas: 9 }",
            "store: `replicas` is at most 8 (it is 9)",
        ),
        (
            "store: { kind: postgres, url: 'postgres://u@h/d', replicas: 1000 }",
            "store: `replicas` is at most 8 (it is 1000)",
        ),
        (
            "leases: { backend: { kind: postgres, url: 'postgres://u@h/d', replicas: 9 }, ttl: 1s }",
            "leases.backend: `replicas` is at most 8 (it is 9)",
        ),
        (
            "leases: { backend: { kind: etcd, url: 'etcd://e:2379', sentinel: { master: m, urls: ['redis://s:1'] } }, ttl: 1s }",
            "leases.backend: `sentinel` is for the redis backend",
        ),
    ] {
        let got = err(&format!("upstream: http://a:1\n{yaml}\n"));
        assert!(got.contains(wanted), "{yaml}\n got: {got}\nwant: {wanted}");
    }
}

#[test]
fn redis_cluster() {
    let c = Config::parse(
        "upstream: http://a:1\n\
         store: { kind: redis, url: 'redis://app:pw@redis-0:6379', cluster: { seeds: ['redis-1:6379', '[fd00::2]:6379'] } }\n\
         leases: { backend: { kind: redis, url: 'redis://redis-0:6379/0', cluster: {}, replicas: 2 }, ttl: 1s }\n",
    )
    .unwrap();
    let remote = c.store.remote().unwrap();
    let cluster = remote.redis.cluster.as_ref().unwrap();
    assert_eq!(cluster.seeds, ["redis-1:6379", "[fd00::2]:6379"]);
    // With Cluster, as with Sentinel, a write waits for one replica unless told otherwise.
    assert_eq!(remote.redis.replicas, 1);
    let backend = c.leases.as_ref().unwrap().backend.remote().unwrap();
    assert_eq!(backend.redis.cluster.as_ref().unwrap().seeds.len(), 0);
    assert_eq!(backend.redis.replicas, 2);
    // Printed as written, and read back the same.
    let yaml = c.to_yaml();
    assert!(yaml.contains("cluster:"), "{yaml}");
    assert_eq!(Config::parse(&yaml).unwrap().to_yaml(), yaml);

    for (yaml, wanted) in [
        (
            "store: { kind: redis, url: 'redis://r:6379', cluster: { seeds: ['r2'] } }",
            "store: `cluster.seeds[0]` is `host:port`, like 10.0.0.2:6379 (it is `r2`)",
        ),
        (
            "store: { kind: redis, url: 'redis://r:6379', cluster: { seeds: ['redis://r2:6379'] } }",
            "store: `cluster.seeds[0]` is `host:port`",
        ),
        (
            "store: { kind: redis, url: 'redis://r:6379/3', cluster: {} }",
            "store: with `cluster`, the `url` names database 0 or none",
        ),
        (
            "store: { kind: redis, url: 'redis://m/', cluster: {}, sentinel: { master: m, urls: ['redis://s:1'] } }",
            "store: `sentinel` and `cluster` exclude each other",
        ),
        (
            "store: { kind: redis, url: 'redis://r:6379', cluster: { nodes: [] } }",
            "store.cluster: unknown field `nodes`",
        ),
        (
            "store: { kind: embedded, cluster: {} }",
            "store: `cluster` is for the redis store",
        ),
        (
            "leases: { backend: { kind: postgres, url: 'postgres://u@h/d', cluster: {} }, ttl: 1s }",
            "leases.backend: `cluster` is for the redis backend",
        ),
    ] {
        let got = err(&format!("upstream: http://a:1\n{yaml}\n"));
        assert!(got.contains(wanted), "{yaml}\n got: {got}\nwant: {wanted}");
    }
}

/// A url that the store's or lease backend's connector could not read is refused when the
/// config loads, with the connector's own reason, so `check` refuses what `run` would.
#[test]
fn urls_no_connector_can_read_are_refused_at_load() {
    let store = |url: &str| err(&format!("upstream: http://a:1\nstore: {{ kind: {url} }}\n"));
    assert_eq!(
        store("redis, url: 'redis://host/abc'"),
        "store: bad redis url: Invalid database number - InvalidClientConfig at line 2 column 8"
    );
    assert_eq!(
        store("redis, url: 'rediss://host/#insecure'"),
        "store: a redis url has no `#` fragment (`#insecure` would skip verifying the server's \
         certificate, which fencegate never does) at line 2 column 8"
    );
    assert_eq!(
        store("postgres, url: 'postgres://host:99999/db'"),
        "store: bad postgres url: invalid connection string: invalid value for option `port` at \
         line 2 column 8"
    );
    assert_eq!(
        store("postgres, url: 'postgres:///db'"),
        "store: bad postgres url: it names no host at line 2 column 8"
    );
    assert_eq!(
        store("etcd, url: 'etcd://'"),
        "store: etcd url names no endpoint at line 2 column 8"
    );
    assert_eq!(
        store("etcd, url: 'https://user@e:2379'"),
        "store: an etcd user needs its password: user:password@host:port at line 2 column 8"
    );
    assert_eq!(
        err("upstream: http://a:1\nleases: { backend: { kind: redis, url: 'redis://h/x' }, ttl: 5s }\n"),
        "leases.backend: bad redis url: Invalid database number - InvalidClientConfig at line 2 \
         column 20"
    );
    assert_eq!(
        err("upstream: http://a:1\nstore: { kind: redis, url: 'redis://m/0', sentinel: { master: m, urls: ['redis://s:26379#insecure'] } }\n"),
        "store: `sentinel.urls[0]`: a redis url has no `#` fragment (`#insecure` would skip \
         verifying the server's certificate, which fencegate never does) at line 2 column 8"
    );
}

/// `****` stands for a password, and only where there is one: a url without a password
/// prints as written, and either loads again as the same url.
#[test]
fn only_a_password_is_masked_and_the_printed_config_loads_again() {
    for (written, printed) in [
        (
            "postgres://postgres@db/fences",
            "postgres://postgres@db/fences",
        ),
        (
            "postgres://app:pw@db/fences",
            "postgres://app:****@db/fences",
        ),
        ("redis://app@h:6379/0", "redis://app@h:6379/0"),
        ("redis://:pw@h:6379/0", "redis://:****@h:6379/0"),
        ("https://u:pw@e:2379", "https://u:****@e:2379"),
    ] {
        let url = SecretUrl::try_from(written.to_owned()).unwrap();
        assert_eq!(url.to_string(), printed);
        let kind = &written[..written.find(':').unwrap()];
        let kind = if kind == "https" { "etcd" } else { kind };
        let c = Config::parse(&format!(
            "upstream: http://a:1\nstore: {{ kind: {kind}, url: '{written}' }}\n"
        ))
        .unwrap();
        let yaml = c.to_yaml();
        assert!(yaml.contains(&format!("url: {printed}\n")), "{yaml}");
        let again = Config::parse(&yaml).unwrap();
        assert_eq!(again.to_yaml(), yaml);
        assert_eq!(again.store.remote().unwrap().url.to_string(), printed);
    }
}

/// A build without the redis and the embedded store and lease backend
/// (`--no-default-features`) refuses a config naming either when it loads (so `check` does
/// too), and says how to get it.
#[test]
#[cfg(not(any(feature = "redis", feature = "embedded")))]
fn a_store_left_out_of_the_build_is_refused_when_the_config_loads() {
    for (kind, yaml) in [
        ("redis", "store: { kind: redis, url: 'redis://r:6379/' }"),
        (
            "redis",
            "leases: { backend: { kind: redis, url: 'redis://r:6379/' }, ttl: 1s }",
        ),
        ("embedded", "store: { kind: embedded }"),
        (
            "embedded",
            "leases: { backend: { kind: embedded }, ttl: 1s }",
        ),
    ] {
        let wanted = format!(
            "this fencegate was built without the `{kind}` store and lease backend: build it \
             with the Cargo feature `{kind}` (the default builds them all)"
        );
        let got = err(&format!("upstream: http://a:1\n{yaml}\n"));
        assert!(got.contains(&wanted), "{yaml}\n got: {got}");
    }
}
