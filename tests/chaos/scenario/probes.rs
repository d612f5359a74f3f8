//! Looks at the rig from outside: committed maxima, direct writes and lease calls, readiness waits.

use super::*;

/// The highest token committed per resource of a group, from the ledger's log.
pub(super) fn committed_maxima(ctx: &Ctx, mode: Mode, group: usize) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let wanted: Vec<String> = resources(mode, group)
        .into_iter()
        .map(|id| format!("account:{id}"))
        .collect();
    for (c, _) in ctx.ledger.log() {
        if wanted.contains(&c.resource) {
            let slot = out.entry(c.resource).or_insert(c.token);
            *slot = (*slot).max(c.token);
        }
    }
    out
}

/// The fence's recorded maxima still cover everything the ledger committed.
pub(super) async fn maxima_kept(ctx: &Ctx, fence: &Fence, group: usize) -> bool {
    for (resource, committed) in committed_maxima(ctx, Mode::Fenced, group) {
        let recorded = recorded_max(fence, &resource).await;
        if recorded.is_none_or(|r| r < committed) {
            println!("  maxima lost on {resource}: recorded {recorded:?}, committed {committed}");
            return false;
        }
    }
    true
}

/// The maximum the fence has recorded for `resource` (its admin API), if it answers one.
pub(super) async fn recorded_max(fence: &Fence, resource: &str) -> Option<u64> {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{}/v1/fences/{resource}", fence.process.admin);
    let (status, body) = request(&client, Method::GET, &url, &[], Bytes::new()).await?;
    (status == 200)
        .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
        .flatten()
        .and_then(|v| v["token"].as_u64())
}

/// Sends one write with `token` directly to the fence (no sidecar), recorded like any other.
pub(super) async fn replay(
    ctx: &Ctx,
    writer: &str,
    group: usize,
    fence: SocketAddr,
    resource: &str,
    token: u64,
) -> u16 {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let id = resource.trim_start_matches("account:");
    let op = format!("{writer}-replay-{}", OP_SEQ.fetch_add(1, Ordering::Relaxed));
    ctx.rec.note_sent(group);
    let sent = ctx.clock.now();
    let answer = request(
        &client,
        Method::PUT,
        &format!("http://{fence}/accounts/{id}"),
        &[
            ("fencing-token", token.to_string()),
            ("x-writer", writer.to_owned()),
            ("x-op", op.clone()),
        ],
        Bytes::from_static(b"replayed"),
    )
    .await;
    let status = answer.as_ref().map_or(0, |(s, _)| *s);
    ctx.rec.push_op(Op {
        writer: writer.to_owned(),
        group,
        op,
        resource: resource.to_owned(),
        token,
        key: None,
        status,
        problem: answer.and_then(|(_, body)| problem_type(&body)),
        sent,
        done: sent,
        answered: ctx.clock.now(),
    });
    status
}

/// A fresh sidecar of the run's lease backend (no egress), named for its holder id.
pub(super) async fn lone_sidecar(ctx: &Ctx, lease_url: &str, holder: &str) -> Fencegate {
    let config = write_config(
        ctx.dir.path(),
        &format!("{holder}.yaml"),
        &sidecar_yaml(
            &ctx.lease_prefix,
            &lease_backend(lease_url, None),
            LOCAL,
            None,
        ),
    );
    Fencegate::start(&config).await
}

/// `POST /v1/leases/{resource}` on a lease API; the token granted, if any.
pub(super) async fn acquire(
    client: &HttpClient<Full<Bytes>>,
    api: SocketAddr,
    resource: &str,
    holder: &str,
    wait: &str,
) -> Option<u64> {
    let (status, body) = request(
        client,
        Method::POST,
        &format!("http://{api}/v1/leases/{resource}"),
        &[("content-type", "application/json".into())],
        Bytes::from(format!(r#"{{"holder":"{holder}","wait":"{wait}"}}"#)),
    )
    .await?;
    (status == 200)
        .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
        .flatten()
        .and_then(|v| v["fencing_token"].as_u64())
}

/// `DELETE /v1/leases/{resource}` on a lease API; its status.
pub(super) async fn release(
    client: &HttpClient<Full<Bytes>>,
    api: SocketAddr,
    resource: &str,
) -> u16 {
    let url = format!("http://{api}/v1/leases/{resource}");
    request(client, Method::DELETE, &url, &[], Bytes::new())
        .await
        .map_or(0, |(s, _)| s)
}

/// The naive control of (f): a sidecar holding a lease is killed without its drain, and the
/// backend is read after its exit.
pub(super) async fn leave_a_lease_behind(ctx: &Ctx, rig: &Rig) -> String {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let holder = "dnaive";
    let mut s = lone_sidecar(ctx, &rig.lease_redis.url(), holder).await;
    let resource = format!("account:{holder}a");
    let token = acquire(&client, s.leases.unwrap(), &resource, holder, "1s").await;
    s.signal("-KILL");
    s.exited(Duration::from_secs(10)).await;
    let exited = ctx.clock.now();
    let held = leases_held_by(&rig.lease_redis.url(), &ctx.lease_prefix, holder).await;
    let text =
        format!("{holder} held {resource} with token {token:?}, killed; backend holds {held:?}");
    ctx.rec.exits.lock().unwrap().push(Exit {
        holder: holder.to_owned(),
        how: "kill -9 (no drain)".into(),
        exited,
        held,
    });
    text
}

/// An HTTP/1.1 head read from a raw connection: its status and everything read after it.
pub(super) async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<u16> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end + 4);
            return head.split_whitespace().nth(1)?.parse().ok();
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Sends a keyed write straight to the authoritative fence with its body in two halves: the
/// head (with `Expect: 100-continue`), then, once the fence asks for the body (it has checked
/// the token against the lease backend: hyper answers `100 Continue` when the body is first
/// read), the first half; then `hand_over` runs; then the second half. Recorded as an op of
/// `writer` whose `done` is the instant the last byte went out.
#[allow(clippy::too_many_arguments)]
pub(super) async fn slow_body_write<F: std::future::Future<Output = ()>>(
    ctx: &Ctx,
    writer: &str,
    group: usize,
    fence: SocketAddr,
    resource: &str,
    token: u64,
    hand_over: F,
) -> Op {
    let id = resource.trim_start_matches("account:");
    let op = format!(
        "{writer}-slowbody-{}",
        OP_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let key = format!("{writer}-kslow{}", OP_SEQ.fetch_add(1, Ordering::Relaxed));
    let body = format!(
        "{key} by {writer} under {token}, sent slowly: {:>32}",
        "end"
    );
    let (first, second) = body.as_bytes().split_at(body.len() / 2);
    let head = format!(
        "PUT /accounts/{id} HTTP/1.1\r\nhost: {fence}\r\nfencing-token: {token}\r\n\
         idempotency-key: {key}\r\nx-writer: {writer}\r\nx-op: {op}\r\n\
         content-length: {}\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n",
        body.len()
    );
    ctx.rec.note_sent(group);
    let sent = ctx.clock.now();
    let mut done = sent;
    let answer = tokio::time::timeout(CLIENT_BOUND, async {
        let mut s = TcpStream::connect(fence).await.ok()?;
        s.write_all(head.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        let status = read_head(&mut s, &mut buf).await?;
        if status == 100 {
            s.write_all(first).await.ok()?;
            hand_over.await;
            s.write_all(second).await.ok()?;
            done = ctx.clock.now();
            let status = read_head(&mut s, &mut buf).await?;
            let _ = s.read_to_end(&mut buf).await;
            return Some((status, buf));
        }
        // Refused at once, before the body was asked for.
        let _ = s.read_to_end(&mut buf).await;
        Some((status, buf))
    })
    .await
    .ok()
    .flatten();
    let (status, problem) = match &answer {
        Some((status, body)) => {
            let text = String::from_utf8_lossy(body);
            let problem = text
                .find("urn:fencegate:")
                .map(|at| text[at..].split('"').next().unwrap_or_default().to_owned());
            (*status, problem)
        }
        None => (0, None),
    };
    let o = Op {
        writer: writer.to_owned(),
        group,
        op,
        resource: resource.to_owned(),
        token,
        key: Some(key),
        status,
        problem,
        sent,
        done,
        answered: ctx.clock.now(),
    };
    ctx.rec.push_op(o.clone());
    o
}

/// Waits (bounded) until the fence refuses `token` on `resource` as stale: it knows a newer
/// grant. The probe carries no op id, so if the fence still lets it through, the ledger
/// refuses it (400) and commits nothing.
pub(super) async fn fence_knows_newer_grant(fence: SocketAddr, resource: &str, token: u64) -> bool {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let id = resource.trim_start_matches("account:");
    let url = format!("http://{fence}/accounts/{id}");
    let probe = async {
        loop {
            let answer = request(
                &client,
                Method::PUT,
                &url,
                &[("fencing-token", token.to_string())],
                Bytes::from_static(b"probe"),
            )
            .await;
            if let Some((409, body)) = &answer {
                if problem_type(body).as_deref() == Some("urn:fencegate:stale-token") {
                    return;
                }
            }
            pace().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), probe)
        .await
        .is_ok()
}

/// Waits (bounded) until the worker holds a lease with at least two writes still to come, so
/// that pausing it before its next write leaves it holding: the lease and its token.
pub(super) async fn holding_with_writes_left(w: &Worker) -> Option<(String, u64)> {
    let mut holding = w.holding.clone();
    tokio::time::timeout(
        Duration::from_secs(20),
        holding.wait_for(|h| matches!(h, Some((_, _, left)) if *left >= 2)),
    )
    .await
    .ok()
    .and_then(|r| r.ok().map(|h| h.clone()))
    .flatten()
    .map(|(resource, token, _)| (resource, token))
}
