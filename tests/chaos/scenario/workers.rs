//! The workers: acquire a lease, write under it through the egress sidecar, release; and the lease event followers.

use super::*;

pub(super) struct WorkerSpec {
    pub(super) ctx: Arc<Ctx>,
    pub(super) name: String,
    pub(super) group: usize,
    pub(super) mode: Mode,
    pub(super) offset: usize,
    pub(super) leases: SocketAddr,
    pub(super) target: SocketAddr,
    pub(super) resources: Vec<String>,
    pub(super) gate: watch::Receiver<bool>,
    pub(super) holding: watch::Sender<Option<(String, u64, usize)>>,
    pub(super) stop: Arc<AtomicBool>,
}

pub(super) static OP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Sends one request, bounded; `None` when no answer came.
pub(super) async fn request<B>(
    client: &HttpClient<B>,
    method: Method,
    url: &str,
    headers: &[(&str, String)],
    body: Bytes,
) -> Option<(u16, Bytes)>
where
    B: From<Bytes> + http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let req = req.body(B::from(body)).unwrap();
    let answer = async {
        let resp = client.request(req).await.ok()?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some((status, body))
    };
    tokio::time::timeout(CLIENT_BOUND, answer)
        .await
        .ok()
        .flatten()
}

/// The problem `type` of a refusal's body.
pub(super) fn problem_type(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned))
}

/// Client retry pacing after a failed call (a real client backs off too).
pub(super) async fn pace() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// A worker: acquire a lease, write a few times under it, release; next resource.
pub(super) async fn worker_loop(mut w: WorkerSpec) {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build_http();
    let rec = Arc::clone(&w.ctx.rec);
    let clock = w.ctx.clock;
    let mut turn = w.offset;
    while !w.stop.load(Ordering::SeqCst) {
        let id = w.resources[turn % w.resources.len()].clone();
        turn += 1;
        let resource = format!("account:{id}");
        let lease_url = format!("http://{}/v1/leases/{resource}", w.leases);
        let body = format!(r#"{{"holder":"{}","wait":"1s"}}"#, w.name);
        let granted = request(
            &client,
            Method::POST,
            &lease_url,
            &[("content-type", "application/json".into())],
            Bytes::from(body),
        )
        .await;
        let at = clock.now();
        let token = match granted {
            Some((200, body)) => serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["fencing_token"].as_u64()),
            _ => None,
        };
        let Some(token) = token else {
            pace().await;
            continue;
        };
        let index = {
            let mut acquired = rec.acquired.lock().unwrap();
            acquired.push(Acquired {
                writer: w.name.clone(),
                resource: resource.clone(),
                token,
                at,
                released: None,
            });
            acquired.len() - 1
        };
        'hold: for k in 0..WRITES_PER_HOLD {
            let _ = w
                .holding
                .send(Some((resource.clone(), token, WRITES_PER_HOLD - k)));
            // The pause point: a frozen worker stops here, wherever its lease stands.
            let _ = w.gate.wait_for(|open| *open).await;
            if w.stop.load(Ordering::SeqCst) {
                break;
            }
            // One write: a key, a body and the token, the same on every attempt. After a
            // timeout (the attempt keeps running: its answer is still recorded), a 503 or a
            // 409 in-flight, the worker retries it, as a client with an idempotency key does.
            let key = format!("{}-k{}", w.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
            let body = Bytes::from(format!("{key} by {} under {token}", w.name));
            for _attempt in 0..MAX_ATTEMPTS {
                let op = format!("{}-{}", w.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
                let url = format!("http://{}/accounts/{id}", w.target);
                let mut headers = vec![
                    ("x-writer", w.name.clone()),
                    ("x-op", op.clone()),
                    ("idempotency-key", key.clone()),
                ];
                if w.mode == Mode::Naive {
                    // No fence: the token goes along, and nobody checks it.
                    headers.push(("fencing-token", token.to_string()));
                }
                rec.note_sent(w.group);
                let sent = clock.now();
                let (tx, rx) = tokio::sync::oneshot::channel();
                let (client, rec, resource, key, body) = (
                    client.clone(),
                    Arc::clone(&rec),
                    resource.clone(),
                    key.clone(),
                    body.clone(),
                );
                let (writer, group) = (w.name.clone(), w.group);
                tokio::spawn(async move {
                    let answer = request(&client, Method::PUT, &url, &headers, body).await;
                    let answered = clock.now();
                    let (status, problem) = match &answer {
                        Some((status, body)) => (*status, problem_type(body)),
                        None => (0, None),
                    };
                    rec.push_op(Op {
                        writer,
                        group,
                        op,
                        resource,
                        token,
                        key: Some(key),
                        status,
                        problem: problem.clone(),
                        sent,
                        done: sent,
                        answered,
                    });
                    let _ = tx.send((status, problem));
                });
                let (status, problem) = match tokio::time::timeout(ATTEMPT_TIMEOUT, rx).await {
                    Ok(Ok(answer)) => answer,
                    // Out of patience: retry while the first attempt runs on.
                    _ => (0, None),
                };
                match (status, problem.as_deref()) {
                    (200..=299, _) => break,
                    (503, Some("urn:fencegate:lease-not-held")) => break 'hold,
                    (0 | 503, _) => pace().await,
                    (409, Some("urn:fencegate:idempotency-in-flight")) => {
                        tokio::time::sleep(IN_FLIGHT_PAUSE).await
                    }
                    _ => {
                        // Refused for good (stale token, ...) or failed upstream: next write.
                        pace().await;
                        break;
                    }
                }
                if w.stop.load(Ordering::SeqCst) {
                    break 'hold;
                }
            }
        }
        let _ = w.holding.send(None);
        // The worker stops acting as holder when it asks for the release.
        rec.acquired.lock().unwrap()[index].released = Some(clock.now());
        let _ = request(&client, Method::DELETE, &lease_url, &[], Bytes::new()).await;
    }
}

/// Follows one sidecar's lease event stream for one resource, recording each event at
/// receipt (renewals move the holder's deadline; the checker needs them).
pub(super) async fn follow_events(
    ctx: Arc<Ctx>,
    writer: String,
    leases: SocketAddr,
    resource: String,
) {
    let client: HttpClient<Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{leases}/v1/leases/{resource}/events");
    let Ok(resp) = client
        .request(Request::get(url).body(Empty::new()).unwrap())
        .await
    else {
        return;
    };
    let mut body = resp.into_body();
    let mut buf = String::new();
    while let Some(Ok(frame)) = body.frame().await {
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let at = ctx.clock.now();
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let kind = event
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or_default()
                .to_owned();
            let data = event
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok());
            let Some(token) = data.and_then(|d| d["fencing_token"].as_u64()) else {
                continue;
            };
            ctx.rec.push_event(LeaseEvent {
                writer: writer.clone(),
                resource: resource.clone(),
                token,
                kind,
                at,
            });
        }
    }
}
