//! The faults, one function each, and `inject`, which runs one and measures the recovery.

use super::*;

/// Injects one fault, ends it, and measures the recovery. `round` counts every fault injected
/// before (ids made from it are the run's own); `nth`, the faults of this kind injected before,
/// which picks a fault's variant in turn (a victim, a length within or past a timeout).
pub(super) async fn inject(
    ctx: &Ctx,
    fault: Fault,
    group: usize,
    round: usize,
    nth: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
) -> Injected {
    let begin = ctx.clock.now();
    let mut note_text = String::new();
    // A failover's length: from the kill to the promotion (a new leader).
    let mut lasted = None;
    let ran = match fault {
        Fault::WorkerFreeze => worker_freeze(ctx, group, nth, rig, evidence, &mut note_text).await,
        Fault::FenceKill9 | Fault::FenceSigterm => {
            fence_restart(ctx, fault, group, rig, evidence).await
        }
        Fault::RedisKill9 => redis_kill9(ctx, group, rig, evidence).await,
        Fault::FenceFreeze => fence_freeze(ctx, group, rig, &mut note_text).await,
        Fault::Partition => partition(ctx, group, rig, evidence, &mut note_text).await,
        Fault::LossyLink => lossy_link(ctx, group, rig, evidence, &mut note_text).await,
        Fault::StoreStall => store_stall(ctx, group, nth, rig, evidence, &mut note_text).await,
        Fault::SlowBody => slow_body(ctx, group, rig, evidence, &mut note_text).await,
        Fault::SigtermWaiting => {
            sigterm_waiting(ctx, group, round, rig, evidence, &mut note_text).await
        }
        Fault::SlowUpstream => slow_upstream(ctx, &mut note_text).await,
        Fault::ConfigReload => config_reload(ctx, group, rig, evidence, &mut note_text).await,
        Fault::ClockStep => clock_step(ctx, group, round, rig, evidence, &mut note_text).await,
        Fault::FullDisk => full_disk(ctx, group, round, rig, evidence, &mut note_text).await,
        Fault::SlowDisk => {
            let past = nth % 2 == 1;
            slow_disk(ctx, group, round, past, rig, evidence, &mut note_text).await
        }
        Fault::StoreLatency => {
            let past = nth % 2 == 1;
            store_latency(ctx, group, round, past, rig, evidence, &mut note_text).await
        }
        Fault::RedisFailover
        | Fault::RedisDeposed
        | Fault::PostgresFailover
        | Fault::EtcdLeaderKill => {
            failover(
                ctx,
                fault,
                group,
                rig,
                evidence,
                &mut note_text,
                &mut lasted,
            )
            .await
        }
    };
    let (end, recovery) = match ran {
        Ok(ran) => ran,
        Err(note) => {
            return Injected {
                fault,
                group,
                duration: Duration::ZERO,
                recovery: None,
                note,
            }
        }
    };
    Injected {
        fault,
        group,
        duration: lasted.unwrap_or(Duration::from_micros(end - begin)),
        recovery: recovery.map(|t| Duration::from_micros(t.saturating_sub(end))),
        note: note_text,
    }
}

/// What injecting one fault came to: when it ended and when the first write after it
/// succeeded (clock microseconds), or why it was skipped or failed.
pub(super) type Injection = Result<(u64, Option<u64>), String>;

/// Evidence counters: what was checked, how often, how often it held.
pub(super) type Evidence = HashMap<String, (usize, usize)>;

/// A worker and its sidecar frozen past the TTL (the GC pause).
pub(super) async fn worker_freeze(
    ctx: &Ctx,
    group: usize,
    nth: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let (fences, workers) = (&mut rig.fences, &mut rig.workers);
    let rec = &ctx.rec;
    let in_group: Vec<usize> = (0..workers.len())
        .filter(|&i| workers[i].group == group)
        .collect();
    let victim = in_group[nth % in_group.len()];
    let w = &mut workers[victim];
    let Some((resource, token)) = holding_with_writes_left(w).await else {
        return Err(format!("skipped: {} never held a lease", w.name));
    };
    let _ = w.gate.send(false);
    w.sidecar.signal("-STOP");
    let frozen_at = ctx.clock.now();
    // Frozen past the TTL: until another worker has committed a higher token on the
    // victim's resource (which needs the lease to have expired in Redis).
    let name = w.name.clone();
    let overtaken = ctx
        .ledger
        .wait_commit(TTL * 6, |c| {
            c.resource == resource && c.token > token && c.writer != name
        })
        .await;
    w.sidecar.signal("-CONT");
    let _ = w.gate.send(true);
    let end = ctx.clock.now();
    note(
        evidence,
        "frozen holder overtaken by a higher token",
        overtaken,
    );
    if let (Some(fence), true) = (fences.get(group), overtaken) {
        // The paused worker also replays its old token straight at the fence, past
        // its own sidecar (a forged or delayed write): it must be refused, not applied.
        let status = replay(ctx, &name, group, fence.process.proxy, &resource, token).await;
        note(
            evidence,
            "old token replayed straight at the fence refused with 409",
            status == 409,
        );
    }
    *note_text = format!(
        "{} held {resource} with token {token}, frozen {}ms, overtaken: {overtaken}",
        w.name,
        (end - frozen_at) / 1000
    );
    let victim_name = w.name.clone();
    let first = rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.writer == victim_name)
        .await;
    Ok((end, first))
}

/// The fence sidecar killed (`kill -9`) or stopped (SIGTERM) under load, and restarted.
pub(super) async fn fence_restart(
    ctx: &Ctx,
    fault: Fault,
    group: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
) -> Injection {
    let fences = &mut rig.fences;
    let rec = &ctx.rec;
    let f = &mut fences[group];
    let status = if fault == Fault::FenceKill9 {
        f.process.signal("-KILL");
        f.process.exited(Duration::from_secs(10)).await
    } else {
        f.process.signal("-TERM");
        f.process.exited(Duration::from_secs(20)).await
    };
    if fault == Fault::FenceSigterm {
        note(
            evidence,
            "fence exits 0 after a SIGTERM drain",
            status.success(),
        );
    }
    f.process = Fencegate::start_with(&f.prefix, &f.config).await;
    let end = ctx.clock.now();
    let kept = maxima_kept(ctx, f, group).await;
    note(
        evidence,
        &format!(
            "recorded maxima >= committed after fence {} ({} store)",
            if fault == Fault::FenceKill9 {
                "kill -9"
            } else {
                "SIGTERM"
            },
            if group == 0 { "embedded" } else { "redis" }
        ),
        kept,
    );
    let first = rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}

/// The fence store's Redis killed (`kill -9`) and restarted.
pub(super) async fn redis_kill9(
    ctx: &Ctx,
    group: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
) -> Injection {
    let fences = &mut rig.fences;
    let rec = &ctx.rec;
    let f = &mut fences[group];
    let redis = f.redis.as_mut().expect("group 1 has its own Redis");
    redis.kill9().await;
    // Down long enough that writes see the store gone (explicit: two writes sent).
    let mut sent = rec.sent_counter(group);
    let before = *sent.borrow();
    let _ = tokio::time::timeout(Duration::from_secs(2), sent.wait_for(|&n| n >= before + 2)).await;
    redis.restart().await;
    let end = ctx.clock.now();
    let first = rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    let kept = maxima_kept(ctx, f, group).await;
    note(
        evidence,
        "recorded maxima >= committed after Redis kill -9 (AOF fsync always)",
        kept,
    );
    Ok((end, first))
}

/// The fence sidecar frozen while requests queue on it.
pub(super) async fn fence_freeze(
    ctx: &Ctx,
    group: usize,
    rig: &mut Rig,
    note_text: &mut String,
) -> Injection {
    let fences = &mut rig.fences;
    let rec = &ctx.rec;
    let f = &mut fences[group];
    let mut in_flight = rec.in_flight(group);
    f.process.signal("-STOP");
    // Frozen while requests queue: until a write per resource of the group (one per
    // lease holder; the other workers wait for those leases) waits on it, bounded.
    let holders = resources(Mode::Fenced, group).len() as u64;
    // Bounded well below the egress sidecars' upstream timeout (5s): they never give
    // up on the frozen fence, so no write is abandoned half-way (see docs).
    let queued = tokio::time::timeout(
        Duration::from_secs(2),
        in_flight.wait_for(|&n| n >= holders),
    )
    .await
    .is_ok();
    // Then stays frozen past the fence's own upstream timeout: on SIGCONT its timers
    // fire late, all at once (the fault's length, not a synchronisation).
    tokio::time::sleep(FENCE_FREEZE_DWELL).await;
    f.process.signal("-CONT");
    let end = ctx.clock.now();
    *note_text = format!("a write per lease queued on the frozen fence: {queued}");
    let first = rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}

/// A sidecar cut off from the lease Redis past the TTL, still running.
pub(super) async fn partition(
    ctx: &Ctx,
    group: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let (fences, workers) = (&mut rig.fences, &mut rig.workers);
    let rec = &ctx.rec;
    let lab = rig
        .lab
        .as_ref()
        .expect("partitions are injected only with namespaces");
    let victim = workers
        .iter()
        .position(|w| w.group == group && w.link.is_some())
        .expect("a worker of each group runs in a namespace");
    let w = &workers[victim];
    let link = w.link.expect("in a namespace");
    let name = w.name.clone();
    let Some((resource, token)) = holding_with_writes_left(w).await else {
        return Err(format!("skipped: {name} never held a lease"));
    };
    // The worker stays at its next write (slow work) while its sidecar, still running,
    // renews into the partition.
    let _ = w.gate.send(false);
    let cut = lab.partition(link, rig.lease_redis.port).await;
    note(
        evidence,
        "partition applied (nftables drop rules added)",
        cut.is_ok(),
    );
    if let Err(e) = cut {
        let _ = w.gate.send(true);
        return Err(format!("failed: {e}"));
    }
    let cut_at = ctx.clock.now();
    let cut_instant = tokio::time::Instant::now();
    // Cut off past the TTL: until another worker has committed a higher token on the
    // victim's resource (which needs the lease to have expired in Redis).
    let overtaken = ctx
        .ledger
        .wait_commit(TTL * 6, |c| {
            c.resource == resource && c.token > token && c.writer != name
        })
        .await;
    note(
        evidence,
        "partitioned holder overtaken by a higher token",
        overtaken,
    );
    // Still cut off, the worker writes again: its own sidecar, whose local deadline
    // passed without a renewal, must no longer attach the token.
    let reopened = ctx.clock.now();
    let _ = w.gate.send(true);
    let next = rec
        .wait_op(reopened, Duration::from_secs(5), |o| o.writer == name)
        .await;
    let refused = next.as_ref().is_some_and(|o| {
        o.status == 503 && o.problem.as_deref() == Some("urn:fencegate:lease-not-held")
    });
    note(
        evidence,
        "partitioned holder's next write refused by its sidecar (503 lease-not-held)",
        refused,
    );
    let lost = rec.events.lock().unwrap().iter().any(|e| {
        e.writer == name && e.resource == resource && e.token == token && e.kind == "lost"
    });
    note(
        evidence,
        "partitioned sidecar reported the lease lost (event `lost`)",
        lost,
    );
    if let (Some(fence), true) = (fences.get(group), overtaken) {
        let status = replay(ctx, &name, group, fence.process.proxy, &resource, token).await;
        note(
            evidence,
            "partitioned holder's old token replayed at the fence refused with 409",
            status == 409,
        );
    }
    // Cut off for at least the TTL (the fault's length, not a synchronisation).
    tokio::time::sleep_until(cut_instant + TTL).await;
    let healed = lab.heal().await;
    let end = ctx.clock.now();
    note(
        evidence,
        "partition healed (nftables rules removed)",
        healed.is_ok(),
    );
    let first = rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.writer == name)
        .await;
    // When it held a lease again (the first grant answered after the heal).
    let regained = rec
        .acquired
        .lock()
        .unwrap()
        .iter()
        .filter(|a| a.writer == name && a.at >= end)
        .map(|a| a.at)
        .min();
    *note_text = format!(
        "{name} held {resource} with token {token}, cut off {}ms, overtaken: {overtaken}, \
             next write {}, lease again {} after the heal",
        (end - cut_at) / 1000,
        next.map_or("unanswered".into(), |o| format!(
            "{} {}",
            o.status,
            o.problem.unwrap_or_default()
        )),
        regained.map_or("-".into(), |t| format!("{}ms", (t - end) / 1000)),
    );
    Ok((end, first))
}

/// The fence store stopped, shorter and longer than `timeouts.store`, while a keyed write is at a slow ledger.
pub(super) async fn store_stall(
    ctx: &Ctx,
    group: usize,
    nth: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let fences = &mut rig.fences;
    let rec = &ctx.rec;
    // Longer than `timeouts.store` twice (both stores), then shorter twice.
    let long = (nth / 2) % 2 == 0;
    let stall = if long { STALL_LONG } else { STALL_SHORT };
    // A keyed write of the group first reaches the ledger and stays there (a slow
    // commit, within the fence's upstream timeout but past its writer's patience, so
    // the writer retries it with its key while the store is stopped).
    let prefix = format!("account:f{group}x");
    let (arrived, done) = ctx.ledger.arm_slow_on(1, STALL_COMMIT, Some(&prefix));
    let at_ledger = ctx
        .ledger
        .slow_arrivals_reach(arrived + 1, Duration::from_secs(10))
        .await;
    let f = &fences[group];
    let stop = |signal: &str| match (&f.postgres, &f.redis) {
        (Some(pg), _) => pg.signal(signal),
        (None, Some(redis)) => redis.signal(signal),
        (None, None) => unreachable!("groups 1 and 2 have a store server"),
    };
    let store = if f.postgres.is_some() {
        "PostgreSQL (postmaster and backends)"
    } else {
        "Redis"
    };
    stop("-STOP");
    // Stopped for the fault's length (not a synchronisation).
    tokio::time::sleep(stall).await;
    stop("-CONT");
    let end = ctx.clock.now();
    let committed = ctx
        .ledger
        .slow_commits_reach(done + 1, Duration::from_secs(10))
        .await;
    ctx.ledger.arm_slow_on(0, STALL_COMMIT, None);
    note(
        evidence,
        "stalled store: a keyed write was at the slow ledger when the store stopped",
        at_ledger,
    );
    *note_text = format!(
        "store {store} stopped {}ms ({} than timeouts.store {}ms) while a keyed write \
             committed in {}ms: at the ledger {at_ledger}, committed {committed}",
        stall.as_millis(),
        if long { "longer" } else { "shorter" },
        STORE_TIMEOUT.as_millis(),
        STALL_COMMIT.as_millis()
    );
    let first = rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}

/// A keyed write's body stalls at the authoritative fence while its lease passes on.
pub(super) async fn slow_body(
    ctx: &Ctx,
    group: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let (fences, workers) = (&mut rig.fences, &mut rig.workers);
    let rec = &ctx.rec;
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let fence = fences[group].process.proxy;
    let in_group: Vec<usize> = (0..workers.len())
        .filter(|&i| workers[i].group == group)
        .collect();
    let (a, b) = (&workers[in_group[0]], &workers[in_group[1]]);
    let (a_api, b_api) = (a.sidecar.leases.unwrap(), b.sidecar.leases.unwrap());
    let resource = format!("account:{SLOW_BODY_ID}");
    let Some(t1) = acquire(&client, a_api, &resource, &a.name, "2s").await else {
        return Err(format!("skipped: {} got no lease on {resource}", a.name));
    };
    let at = ctx.clock.now();
    let a_index = {
        let mut acquired = rec.acquired.lock().unwrap();
        acquired.push(Acquired {
            writer: a.name.clone(),
            resource: resource.clone(),
            token: t1,
            at,
            released: None,
        });
        acquired.len() - 1
    };
    // Mid-body: the holder lets go, the other worker is granted the lease, and the
    // fence is seen to know the newer grant (it refuses the old token, 409).
    let mut t2 = None;
    let mut known = false;
    let hand_over = async {
        rec.acquired.lock().unwrap()[a_index].released = Some(ctx.clock.now());
        release(&client, a_api, &resource).await;
        t2 = acquire(&client, b_api, &resource, &b.name, "2s").await;
        if let Some(t2) = t2 {
            rec.acquired.lock().unwrap().push(Acquired {
                writer: b.name.clone(),
                resource: resource.clone(),
                token: t2,
                at: ctx.clock.now(),
                released: None,
            });
            known = fence_knows_newer_grant(fence, &resource, t1).await;
        }
    };
    let op = slow_body_write(ctx, &a.name, group, fence, &resource, t1, hand_over).await;
    let end = ctx.clock.now();
    let kept = rec.acquired.lock().unwrap()[a_index].released.is_none();
    if kept {
        // Refused before the body was asked for: no hand-over happened.
        rec.acquired.lock().unwrap()[a_index].released = Some(end);
        release(&client, a_api, &resource).await;
    }
    note(
            evidence,
            "slow body: the fence asked for the body (100 Continue), the lease passed on mid-body and the fence refused the old token before the body ended",
            t2.is_some() && known,
        );
    note(
        evidence,
        "slow body: the write with the superseded token, ended after the hand-over, refused (409)",
        op.status == 409,
    );
    // The new holder writes under its token through its egress, then lets go.
    let mut first = None;
    if let Some(t2) = t2 {
        let key = format!("{}-k{}", b.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
        let o = format!("{}-{}", b.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
        rec.note_sent(group);
        let sent = ctx.clock.now();
        let answer = request(
            &client,
            Method::PUT,
            &format!(
                "http://{}/accounts/{SLOW_BODY_ID}",
                b.sidecar.egress.unwrap()
            ),
            &[
                ("x-writer", b.name.clone()),
                ("x-op", o.clone()),
                ("idempotency-key", key.clone()),
            ],
            Bytes::from(format!("{key} by {} under {t2}", b.name)),
        )
        .await;
        let answered = ctx.clock.now();
        let status = answer.as_ref().map_or(0, |(s, _)| *s);
        rec.push_op(Op {
            writer: b.name.clone(),
            group,
            op: o,
            resource: resource.clone(),
            token: t2,
            key: Some(key),
            status,
            problem: answer.and_then(|(_, body)| problem_type(&body)),
            sent,
            done: sent,
            answered,
        });
        if (200..300).contains(&status) {
            first = Some(answered);
        }
        if let Some(mine) = rec
            .acquired
            .lock()
            .unwrap()
            .iter_mut()
            .rev()
            .find(|x| x.writer == b.name && x.resource == resource && x.token == t2)
        {
            mine.released = Some(ctx.clock.now());
        }
        release(&client, b_api, &resource).await;
    }
    *note_text = format!(
        "{} (token {t1}) sent half a body, lease passed to {} (token {}), fence knew: {known}; \
             the body ended {}ms after its head: {} {}",
        a.name,
        b.name,
        t2.map_or("-".into(), |t| t.to_string()),
        (op.done - op.sent) / 1000,
        op.status,
        op.problem.unwrap_or_default()
    );
    Ok((end, first))
}

/// A sidecar stopped while an acquisition waits on its lease API.
pub(super) async fn sigterm_waiting(
    ctx: &Ctx,
    group: usize,
    round: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let workers = &mut rig.workers;
    let rec = &ctx.rec;
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let lease_url = rig.lease_redis.url();
    let holder = format!("d{round}");
    let mut s = lone_sidecar(ctx, &lease_url, &holder).await;
    let api = s.leases.unwrap();
    // It holds one lease (the drain must give it back) and waits for another, held by
    // a worker's sidecar.
    let (own, wanted) = (format!("account:{holder}a"), format!("account:{holder}b"));
    let mine = acquire(&client, api, &own, &holder, "1s").await;
    let rival = workers.iter().find(|w| w.group == group).expect("a worker");
    let (rival_api, rival_name) = (rival.sidecar.leases.unwrap(), rival.name.clone());
    let theirs = acquire(&client, rival_api, &wanted, &rival_name, "1s").await;
    let waiting = {
        let client = client.clone();
        let holder = holder.clone();
        let wanted = wanted.clone();
        tokio::spawn(async move { acquire(&client, api, &wanted, &holder, "3s").await })
    };
    // Readiness: the sidecar lists the acquisition as under way.
    let url = format!("http://{api}/v1/leases/{wanted}");
    let under_way = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            if let Some((200, body)) = request(&client, Method::GET, &url, &[], Bytes::new()).await
            {
                if serde_json::from_slice::<serde_json::Value>(&body)
                    .is_ok_and(|v| v["state"] == "acquiring")
                {
                    return;
                }
            }
            pace().await;
        }
    })
    .await
    .is_ok();
    s.signal("-TERM");
    let drained = wait_log(&mut s.logs, "leases released", Duration::from_secs(10))
        .await
        .is_ok();
    // The drain has given back what it held; now the awaited lease comes free.
    release(&client, rival_api, &wanted).await;
    let status = s.exited(Duration::from_secs(20)).await;
    let end = ctx.clock.now();
    let granted = waiting.await.ok().flatten();
    let held = leases_held_by(&lease_url, &ctx.lease_prefix, &holder).await;
    note(
            evidence,
            "SIGTERM with an acquisition waiting: it was under way, the drain logged `leases released`, the sidecar exited 0",
            mine.is_some() && theirs.is_some() && under_way && drained && status.success(),
        );
    *note_text = format!(
            "{holder} held {own} ({mine:?}), waited for {wanted} held by {rival_name} ({theirs:?}); \
             waiting acquisition answered {granted:?}; exit {status}; backend holds for {holder}: {held:?}"
        );
    rec.exits.lock().unwrap().push(Exit {
        holder,
        how: "SIGTERM (drain)".into(),
        exited: end,
        held,
    });
    let first = rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}

/// The ledger commits slower than the fence's upstream timeout.
pub(super) async fn slow_upstream(ctx: &Ctx, note_text: &mut String) -> Injection {
    let rec = &ctx.rec;
    let n = 3;
    let before = ctx.ledger.arm_slow(n);
    let done = ctx
        .ledger
        .slow_commits_reach(before + n, Duration::from_secs(10))
        .await;
    ctx.ledger.arm_slow(0);
    let end = ctx.clock.now();
    *note_text = format!("{n} commits delayed {}ms: {done}", SLOW_COMMIT.as_millis());
    let first = rec.wait_ok(end, 1, Duration::from_secs(20), |_| true).await;
    Ok((end, first))
}

/// The fence's config file changed under load, as an operator or a ConfigMap swap does it: to
/// YAML that does not parse (refused: the running config stays), to a valid edit (one more
/// route, unfenced), and back; each picked up at a SIGHUP (or the file poll, whichever is
/// first). Writes keep flowing through the fence meanwhile; the run's invariants say whether
/// any was admitted that should not have been.
pub(super) async fn config_reload(
    ctx: &Ctx,
    group: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let f = &rig.fences[group];
    let original = std::fs::read_to_string(&f.config).map_err(|e| e.to_string())?;
    let admin = f.process.admin;
    let edited = format!("{original}  - {{ name: health, path: /healthz, fence: false }}\n");
    let steps = [
        (format!("{original}routes: [unclosed\n"), "refused"),
        (edited, "applied"),
        (original.clone(), "applied"),
    ];
    let mut outcomes = Vec::new();
    for (content, expected) in steps {
        let before = reloads(admin, expected).await.unwrap_or(0);
        // Replaced whole (a rename), as a ConfigMap swap does: never read half-written.
        let next = f.config.with_extension("next");
        std::fs::write(&next, content).map_err(|e| e.to_string())?;
        std::fs::rename(&next, &f.config).map_err(|e| e.to_string())?;
        f.process.signal("-HUP");
        let seen = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if reloads(admin, expected).await.unwrap_or(0) > before {
                    return;
                }
                pace().await;
            }
        })
        .await
        .is_ok();
        outcomes.push(format!("{expected}: {seen}"));
        note(
            evidence,
            &format!("config reload under load: a {expected} file is {expected}"),
            seen,
        );
    }
    let end = ctx.clock.now();
    *note_text = outcomes.join(", ");
    let first = ctx
        .rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}

/// `fencegate_config_reloads_total{result}` of the fence whose admin listener is `admin`.
async fn reloads(admin: SocketAddr, result: &str) -> Option<u64> {
    let scrape = async {
        let mut s = TcpStream::connect(admin).await.ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: fence\r\nconnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).await.ok()?;
        let key = format!("fencegate_config_reloads_total{{result=\"{result}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(key.as_str())?.trim().parse().ok())
    };
    tokio::time::timeout(Duration::from_secs(2), scrape)
        .await
        .ok()
        .flatten()
}

/// The fence store's primary (etcd: leader) killed with `kill -9`. The topology fails over on
/// its own (the Sentinels promote a replica; the other etcd members elect a leader) or as a
/// failover manager would do it (`pg_ctl promote` of the synchronous standby), fencegate follows
/// without a restart, and the topology is brought back to full strength for the next round
/// (the old Redis primary rejoins as a replica; a new standby is made from the promoted
/// PostgreSQL; the etcd member is restarted). Ends at the kill: the recovery is kill -> first
/// admitted write of the group.
pub(super) async fn failover(
    ctx: &Ctx,
    fault: Fault,
    group: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
    lasted: &mut Option<Duration>,
) -> Injection {
    let f = &mut rig.fences[group];
    let Some(topology) = f.replicated.as_mut() else {
        return Err("skipped: the group's store is not replicated".into());
    };
    let kind = match fault {
        Fault::RedisFailover => "a Redis Sentinel failover (replicas: 1)",
        Fault::RedisDeposed => "a Sentinel failover of a primary that still serves (replicas: 1)",
        Fault::PostgresFailover => "a PostgreSQL standby promotion (replicas: 1)",
        _ => "an etcd leader kill",
    };
    let mut killed = None;
    let mut promoted = None;
    // Kill, fail over, back to full strength; what happened, or where it stopped.
    let steps: Result<String, String> = async {
        match topology {
            Replicated::Sentinel(s) if fault == Fault::RedisDeposed => {
                let old = s.depose_primary().await?;
                killed = Some(ctx.clock.now());
                let new = s.wait_promoted(old).await?;
                promoted = Some(ctx.clock.now());
                s.readmit(old).await?;
                Ok(format!(
                    "primary :{old} deposed while serving, the Sentinels promoted :{new}, :{old} answered them again and rejoined as a replica"
                ))
            }
            Replicated::Sentinel(s) => {
                let old = s.kill_primary().await?;
                killed = Some(ctx.clock.now());
                let new = s.wait_promoted(old).await?;
                promoted = Some(ctx.clock.now());
                s.rejoin(old, new).await?;
                Ok(format!(
                    "primary :{old} killed, the Sentinels promoted :{new}, :{old} rejoined as its replica"
                ))
            }
            Replicated::Postgres(pg) => {
                let old = pg.kill_primary().await?;
                killed = Some(ctx.clock.now());
                let new = pg.promote().await?;
                promoted = Some(ctx.clock.now());
                pg.rebuild_standby().await?;
                Ok(format!(
                    "primary :{old} killed, standby :{new} promoted, a new synchronous standby of it on :{old}"
                ))
            }
            Replicated::Etcd(etcd) => {
                let leader = etcd.leader().await?;
                etcd.kill(leader).await;
                killed = Some(ctx.clock.now());
                etcd.wait_leader().await?;
                promoted = Some(ctx.clock.now());
                let new = etcd.leader().await?;
                etcd.restart(leader).await?;
                Ok(format!(
                    "leader m{leader} killed, m{new} elected, m{leader} restarted and healthy"
                ))
            }
        }
    }
    .await;
    let back = ctx.clock.now();
    note(
        evidence,
        &format!(
            "{kind}: primary (leader) killed, another promoted (elected), back to full strength"
        ),
        steps.is_ok(),
    );
    let Some(killed) = killed else {
        return Err(format!("failed before the kill: {}", steps.unwrap_err()));
    };
    *lasted = promoted.map(|p| Duration::from_micros(p - killed));
    // The first write of the group sent after the kill and admitted (through the new primary).
    let first = ctx
        .rec
        .wait_ok(killed, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    // Every raise the ledger committed was acknowledged by the store: the promoted primary
    // (new leader) still holds it.
    let kept = maxima_kept(ctx, f, group).await;
    note(
        evidence,
        &format!("recorded maxima >= committed after {kind}"),
        kept,
    );
    let mut leases = String::new();
    let mut leases_ok = true;
    if matches!(fault, Fault::RedisFailover | Fault::RedisDeposed) {
        // The group's lease backend is on the same Sentinels: it granted leases again after
        // the failover, and never the same token twice on a resource.
        let tag = format!("account:f{group}x");
        let acquired = ctx.rec.acquired.lock().unwrap();
        let ours: Vec<&Acquired> = acquired
            .iter()
            .filter(|a| a.resource.starts_with(&tag))
            .collect();
        let after = ours.iter().filter(|a| a.at >= killed).count();
        let distinct: std::collections::HashSet<(&str, u64)> = ours
            .iter()
            .map(|a| (a.resource.as_str(), a.token))
            .collect();
        let repeated = ours.len() - distinct.len();
        leases_ok = after > 0 && repeated == 0;
        note(
            evidence,
            "lease backend on the same Sentinels: grants again after the failover, no token granted twice",
            leases_ok,
        );
        leases = format!(", lease grants since the kill {after}, tokens granted twice {repeated}");
    }
    if let (Some(Replicated::Sentinel(s)), false) =
        (f.replicated.as_ref(), steps.is_ok() && kept && leases_ok)
    {
        println!("  the Sentinel topology now:\n{}", s.describe().await);
    }
    // A token below the highest committed one, replayed straight at the fence, is refused.
    let top = ctx
        .ledger
        .log()
        .into_iter()
        .map(|(c, _)| c)
        .filter(|c| c.resource.starts_with(&format!("account:f{group}x")))
        .max_by_key(|c| c.token);
    let mut stale = String::new();
    let top = top.filter(|c| c.token > 1);
    // Without a committed token above 1 there is nothing stale to replay: the check is not
    // skipped in silence.
    note(
        evidence,
        &format!("a token above 1 was committed before {kind}, so a stale one can be replayed"),
        top.is_some(),
    );
    if let Some(top) = top {
        let status = replay_answered(
            ctx,
            &top.writer,
            group,
            f.process.proxy,
            &top.resource,
            top.token - 1,
        )
        .await;
        note(
            evidence,
            &format!("stale token replayed at the fence refused with 409 after {kind}"),
            status == 409,
        );
        stale = format!(", stale {} on {}: {status}", top.token - 1, top.resource);
    }
    *note_text = format!(
        "{}; promoted {}ms after the kill, full strength again after {}ms{stale}{leases}",
        steps.unwrap_or_else(|e| format!("FAILED: {e}")),
        promoted.map_or("-".into(), |p| ((p - killed) / 1000).to_string()),
        (back - killed) / 1000
    );
    Ok((killed, first))
}

/// [`replay`] until the fence answers other than `503` (its store failing over), bounded.
async fn replay_answered(
    ctx: &Ctx,
    writer: &str,
    group: usize,
    fence: SocketAddr,
    resource: &str,
    token: u64,
) -> u16 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let status = replay(ctx, writer, group, fence, resource, token).await;
        if status != 503 || tokio::time::Instant::now() >= deadline {
            return status;
        }
        pace().await;
    }
}

/// The fence's wall clock stepped an hour ahead, then a day back, then right again (group 0:
/// the embedded store, whose idempotency records outlive a restart by the wall clock). A
/// keyed write completed before each step is retried after it, within the window: it must be
/// answered from its record, not run again (the ledger would apply the key twice: invariant
/// (e)). Skipped without libfaketime.
pub(super) async fn clock_step(
    ctx: &Ctx,
    group: usize,
    round: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let f = &rig.fences[group];
    let Some(clock) = f.clock.clone() else {
        return Err("skipped: libfaketime is not installed (apt-get install libfaketime)".into());
    };
    let fence = f.process.proxy;
    let path = format!("/accounts/clk{round}");
    let token = round as u64 + 1;
    let put = |key: &'static str| keyed_put(fence, &path, token, key, round);
    let step = |offset: &str| std::fs::write(&clock, format!("{offset}\n"));
    let mut outcomes = Vec::new();
    let first = put("before").await;
    outcomes.push(format!("written: {first:?}"));
    step("+3600").map_err(|e| e.to_string())?;
    let ahead = put("before").await;
    let during = put("ahead").await;
    step("-86400").map_err(|e| e.to_string())?;
    let back = put("ahead").await;
    step("+0").map_err(|e| e.to_string())?;
    let end = ctx.clock.now();
    outcomes.push(format!("an hour ahead: {ahead:?}, a day back: {back:?}"));
    let executed = |a: Option<(u16, bool)>| a == Some((200, false));
    let replayed = |a: Option<(u16, bool)>| a == Some((200, true));
    note(
        evidence,
        "clock step: the wall clock an hour ahead, a key completed before is replayed, not run again",
        executed(first) && replayed(ahead),
    );
    note(
        evidence,
        "clock step: the wall clock a day back, a key completed before is replayed, not run again",
        executed(during) && replayed(back),
    );
    *note_text = outcomes.join("; ");
    let first_ok = ctx
        .rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first_ok))
}

/// The op id (and idempotency key) of the harness's keyed write `key` in fault round `round`.
fn keyed_op(round: usize, key: &str) -> String {
    format!("clk{round}-{key}")
}

/// A `PUT` of `path` with `token` and the idempotency key `key` (made unique by `round`),
/// straight to the fence: its status and whether it was answered from the key's record.
async fn keyed_put(
    fence: SocketAddr,
    path: &str,
    token: u64,
    key: &str,
    round: usize,
) -> Option<(u16, bool)> {
    let op = keyed_op(round, key);
    let body = format!("clock step {round} {key}");
    let request = format!(
        "PUT {path} HTTP/1.1\r\nhost: fence\r\nconnection: close\r\nfencing-token: {token}\r\n\
         idempotency-key: {op}\r\nx-writer: {HARNESS_WRITER}\r\nx-op: {op}\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut s = TcpStream::connect(fence).await.ok()?;
        s.write_all(request.as_bytes()).await.ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).await.ok()?;
        let status = text.split(' ').nth(1)?.parse().ok()?;
        let head = text.split("\r\n\r\n").next()?.to_ascii_lowercase();
        Some((status, head.contains("\r\nidempotent-replayed: true")))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .ok()
        .flatten()
}

/// How long the embedded store's disk stays full while the group writes.
const FULL_DISK_DWELL: Duration = Duration::from_millis(1500);

/// The embedded store's disk (group 0's tmpfs) filled to the last byte while the group
/// writes, then emptied; then the fence is killed (-9) and restarted, and its recorded maxima
/// compared with the ledger: every write it admitted while the disk was full must have been
/// durable. Skipped where the tmpfs could not be mounted.
pub(super) async fn full_disk(
    ctx: &Ctx,
    group: usize,
    round: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let f = &mut rig.fences[group];
    let Some(disk) = &f.disk else {
        return Err("skipped: no tmpfs for the embedded store (mounting one needs root)".into());
    };
    let filler = disk.path.join("filler");
    let filled = fill(&filler);
    let since = ctx.clock.now();
    // Besides the group's own writes (which mostly rewrite pages the file already has), new
    // resources with long ids, which grow it: the first one it cannot hold must be refused.
    let fence = f.process.proxy;
    let growing = async {
        for i in 0..4000 {
            let path = format!("/accounts/full{round}x{i}{}", "y".repeat(400));
            match keyed_put(fence, &path, 1, &format!("g{i}"), round).await {
                Some((200, _)) => continue,
                other => return (i, other),
            }
        }
        (4000, None)
    };
    let ((grown, refusal), ()) = tokio::join!(growing, tokio::time::sleep(FULL_DISK_DWELL));
    let until = ctx.clock.now();
    let _ = std::fs::remove_file(&filler);
    let filled = filled?;
    note(
        evidence,
        "full disk: a write whose raise needs more room than the disk has is refused (503 store-unavailable)",
        refusal.is_some_and(|(status, _)| status == 503),
    );
    // Room again: the fence takes writes again without a restart.
    let again = keyed_put(
        fence,
        &format!("/accounts/full{round}again"),
        1,
        "again",
        round,
    )
    .await;
    note(
        evidence,
        "full disk: once it has room, the fence takes writes again without a restart",
        again.is_some_and(|(status, _)| status == 200),
    );
    let (admitted, refused) = group_answers(ctx, group, since, until);
    f.process.signal("-KILL");
    f.process.exited(Duration::from_secs(10)).await;
    f.process = Fencegate::start_with(&f.prefix, &f.config).await;
    let end = ctx.clock.now();
    let kept = maxima_kept(ctx, f, group).await;
    note(
        evidence,
        "full disk: recorded maxima >= committed after the disk filled and emptied and the fence was killed (-9)",
        kept,
    );
    *note_text = format!(
        "{} MiB of filler; while full: {admitted} of the group's writes admitted, {refused} refused \
         503 store-unavailable; new resources admitted before the first refusal: {grown} \
         ({refusal:?}); with room again: {again:?}",
        filled >> 20
    );
    let first = ctx
        .rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}

/// Writes zeros to `path` until the file system is full: the bytes written.
fn fill(path: &std::path::Path) -> Result<u64, String> {
    use std::io::Write;
    let mut file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let mut written = 0u64;
    for size in [1 << 20, 4096, 1] {
        let chunk = vec![0u8; size];
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(28) => break,
                Err(e) => return Err(format!("filling the disk: {e}")),
            }
        }
    }
    Ok(written)
}

/// How many packets in 100 the lossy link drops, and for how long.
const LOSS_PERCENT: u8 = 30;
const LOSSY_DWELL: Duration = Duration::from_secs(2);

/// A lossy link between a namespaced worker's sidecar and the lease Redis: 30 packets in 100
/// dropped both ways, for 2 s, while the worker keeps writing. Its sidecar renews through the
/// losses (TCP retransmits) or loses the lease cleanly (its local deadline passes, it stops
/// attaching the token); either way the run's invariants must hold, and the worker writes
/// again once the link is whole.
pub(super) async fn lossy_link(
    ctx: &Ctx,
    group: usize,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let Some(lab) = rig.lab.as_ref() else {
        return Err("skipped: no network namespaces".into());
    };
    let Some(w) = rig
        .workers
        .iter()
        .find(|w| w.group == group && w.link.is_some())
    else {
        return Err(format!("skipped: no namespaced worker in group {group}"));
    };
    let (link, name) = (w.link.expect("namespaced"), w.name.clone());
    let since = ctx.clock.now();
    let made = lab.lossy(link, rig.lease_redis.port, LOSS_PERCENT).await;
    note(
        evidence,
        "lossy link applied (nftables random drop rules added)",
        made.is_ok(),
    );
    if let Err(e) = made {
        let _ = lab.heal().await;
        return Err(format!("failed: {e}"));
    }
    tokio::time::sleep(LOSSY_DWELL).await;
    let healed = lab.heal().await;
    note(
        evidence,
        "lossy link healed (nftables rules removed)",
        healed.is_ok(),
    );
    let end = ctx.clock.now();
    let (mut admitted, mut not_held, mut other) = (0, 0, 0);
    for o in ctx.rec.ops.lock().unwrap().iter() {
        if o.writer == name && o.sent >= since && o.answered <= end {
            match (o.status, o.problem.as_deref()) {
                (200..=299, _) => admitted += 1,
                (503, Some("urn:fencegate:lease-not-held")) => not_held += 1,
                _ => other += 1,
            }
        }
    }
    *note_text = format!(
        "{LOSS_PERCENT}% of the packets between {name}'s sidecar and the lease Redis dropped for \
         {}ms: {admitted} of its writes admitted, {not_held} refused lease-not-held, {other} other",
        LOSSY_DWELL.as_millis()
    );
    let first = ctx
        .rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.writer == name)
        .await;
    Ok((end, first))
}

/// The slow-disk fault's fsync delays: within `timeouts.store` and past it, in turn.
const SLOW_SYNC_WITHIN: Duration = Duration::from_millis(200);
const SLOW_SYNC_PAST: Duration = Duration::from_millis(900);
/// The added-latency fault's one-way delays (a store round trip takes twice it): within
/// `timeouts.store` and past it, in turn.
const LATENCY_WITHIN: Duration = Duration::from_millis(100);
const LATENCY_PAST: Duration = Duration::from_millis(400);
/// How long the disk stays slow, or the link, while the group writes and the probes run.
const SLOW_DWELL: Duration = Duration::from_millis(1500);

/// One probe: a keyed write with token 1 to a resource nobody wrote before, so that its raise
/// must reach the store. Its op id, its answer and how long the answer took.
struct Probe {
    op: String,
    resource: String,
    answer: Option<(u16, bool)>,
    took: Duration,
}

/// Probes `fence` one after another for `dwell`, each on a resource of its own.
async fn probe_new_resources(
    fence: SocketAddr,
    tag: &str,
    round: usize,
    dwell: Duration,
) -> Vec<Probe> {
    let until = std::time::Instant::now() + dwell;
    let mut probes = Vec::new();
    for i in 0.. {
        if std::time::Instant::now() >= until {
            break;
        }
        let id = format!("{tag}{round}x{i}");
        let key = format!("{tag}{i}");
        let started = std::time::Instant::now();
        let answer = keyed_put(fence, &format!("/accounts/{id}"), 1, &key, round).await;
        probes.push(Probe {
            op: keyed_op(round, &key),
            resource: format!("account:{id}"),
            answer,
            took: started.elapsed(),
        });
    }
    probes
}

/// What probes made while a store was slow show: within `timeouts.store`, every one admitted
/// and none answered before `floor` (so none was forwarded before the store's answer); past
/// it, every one refused `503 store-unavailable` and none committed at the ledger.
fn judge_probes(
    ctx: &Ctx,
    evidence: &mut Evidence,
    what: &str,
    probes: &[Probe],
    past: bool,
    floor: Duration,
) -> String {
    let admitted = probes
        .iter()
        .filter(|p| p.answer.is_some_and(|(s, _)| s == 200))
        .count();
    let quickest = probes.iter().map(|p| p.took).min().unwrap_or_default();
    let committed: std::collections::HashSet<String> =
        ctx.ledger.log().into_iter().map(|(c, _)| c.op).collect();
    if past {
        let refused = probes
            .iter()
            .filter(|p| p.answer.is_some_and(|(s, _)| s == 503))
            .count();
        let forwarded = probes.iter().filter(|p| committed.contains(&p.op)).count();
        note(
            evidence,
            &format!(
                "{what} past timeouts.store: every probe refused 503, none reached the ledger"
            ),
            !probes.is_empty() && refused == probes.len() && forwarded == 0,
        );
        format!(
            "{} probes: {refused} refused 503, {forwarded} at the ledger",
            probes.len()
        )
    } else {
        note(
            evidence,
            &format!(
                "{what} within timeouts.store: every probe admitted, none answered before the store could answer"
            ),
            !probes.is_empty() && admitted == probes.len() && quickest >= floor,
        );
        format!(
            "{} probes: {admitted} admitted, the quickest in {}ms (floor {}ms)",
            probes.len(),
            quickest.as_millis(),
            floor.as_millis()
        )
    }
}

/// The group's writes while the fault lasted: admitted, refused `503 store-unavailable`.
fn group_answers(ctx: &Ctx, group: usize, since: u64, until: u64) -> (usize, usize) {
    let (mut admitted, mut refused) = (0, 0);
    for o in ctx.rec.ops.lock().unwrap().iter() {
        if o.group == group && o.sent >= since && o.answered <= until {
            match o.status {
                200..=299 => admitted += 1,
                503 if o.problem.as_deref() == Some("urn:fencegate:store-unavailable") => {
                    refused += 1
                }
                _ => {}
            }
        }
    }
    (admitted, refused)
}

/// The embedded store's fsyncs made slow (group 0, the slow-disk library reading its delay
/// from a file), within `timeouts.store` one round and past it the next, while the group writes
/// and probes write new resources; then the fence is killed (-9) and restarted, and every
/// maximum the ledger committed, and every admitted probe, must still be recorded.
pub(super) async fn slow_disk(
    ctx: &Ctx,
    group: usize,
    round: usize,
    past: bool,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let f = &mut rig.fences[group];
    let Some(delay_file) = f.slow_disk.clone() else {
        return Err("skipped: the slow-disk library could not be built (cc)".into());
    };
    let delay = if past {
        SLOW_SYNC_PAST
    } else {
        SLOW_SYNC_WITHIN
    };
    let since = ctx.clock.now();
    std::fs::write(&delay_file, format!("{}\n", delay.as_millis()))
        .map_err(|e| format!("failed: writing the disk delay: {e}"))?;
    let probes = probe_new_resources(f.process.proxy, "disk", round, SLOW_DWELL).await;
    let healed = std::fs::write(&delay_file, "0\n");
    let until = ctx.clock.now();
    healed.map_err(|e| format!("failed: clearing the disk delay: {e}"))?;
    let judged = judge_probes(ctx, evidence, "slow disk", &probes, past, delay);
    let (admitted, refused) = group_answers(ctx, group, since, until);
    f.process.signal("-KILL");
    f.process.exited(Duration::from_secs(10)).await;
    f.process = Fencegate::start_with(&f.prefix, &f.config).await;
    let end = ctx.clock.now();
    let mut kept = maxima_kept(ctx, f, group).await;
    for p in probes
        .iter()
        .filter(|p| p.answer.is_some_and(|(s, _)| s == 200))
    {
        kept &= recorded_max(f, &p.resource).await.is_some_and(|t| t >= 1);
    }
    note(
        evidence,
        "slow disk: recorded maxima >= committed, every admitted probe recorded, after kill -9",
        kept,
    );
    *note_text = format!(
        "fsyncs {}ms ({} timeouts.store {}ms): {judged}; the group's writes meanwhile: \
         {admitted} admitted, {refused} refused 503 store-unavailable; maxima kept after kill -9: {kept}",
        delay.as_millis(),
        if past { "past" } else { "within" },
        STORE_TIMEOUT.as_millis()
    );
    let first = ctx
        .rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}

/// Latency added between group 1's fence and its Redis store (the relay its store url names),
/// within `timeouts.store` one round and past it the next, while the group writes and probes
/// write new resources.
pub(super) async fn store_latency(
    ctx: &Ctx,
    group: usize,
    round: usize,
    past: bool,
    rig: &mut Rig,
    evidence: &mut Evidence,
    note_text: &mut String,
) -> Injection {
    let f = &rig.fences[group];
    let Some(relay) = &f.relay else {
        return Err(format!("skipped: group {group}'s store has no relay"));
    };
    let delay = if past { LATENCY_PAST } else { LATENCY_WITHIN };
    let since = ctx.clock.now();
    relay.set_delay(delay);
    let probes = probe_new_resources(f.process.proxy, "lat", round, SLOW_DWELL).await;
    relay.set_delay(Duration::ZERO);
    let end = ctx.clock.now();
    // A probe waits for at least one round trip to the store before it is forwarded.
    let judged = judge_probes(ctx, evidence, "store latency", &probes, past, delay * 2);
    let (admitted, refused) = group_answers(ctx, group, since, end);
    *note_text = format!(
        "{}ms each way ({} timeouts.store {}ms): {judged}; the group's writes meanwhile: \
         {admitted} admitted, {refused} refused 503 store-unavailable",
        delay.as_millis(),
        if past { "past" } else { "within" },
        STORE_TIMEOUT.as_millis()
    );
    let first = ctx
        .rec
        .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
        .await;
    Ok((end, first))
}
