//! A TCP relay that adds latency: the added-latency fault's link between a fence and its
//! store. This kernel has no `sch_netem`, so the delay is made in user space: every chunk read
//! from one side is written to the other once its delay has passed, in the order read, so the
//! byte streams are those of a slow link, not a reordering one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Listens on a port of its own and relays every connection to `target`, each way delayed by
/// the current one-way delay (0 at first).
pub struct Relay {
    pub port: u16,
    delay_ms: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Relay {
    pub async fn start(target: u16) -> Relay {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let delay = Arc::clone(&delay_ms);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let delay = Arc::clone(&delay);
                tokio::spawn(async move {
                    // The store down (killed, restarting): the client's connection closes,
                    // as it would without the relay.
                    let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(
                        pipe(cr, sw, Arc::clone(&delay)),
                        pipe(sr, cw, Arc::clone(&delay))
                    );
                });
            }
        });
        Relay {
            port,
            delay_ms,
            accept,
        }
    }

    /// The one-way delay from now on (a round trip takes twice it).
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to`, each chunk held until its delay (read when it arrived) has passed.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay_ms: Arc<AtomicU64>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let due =
                        Instant::now() + Duration::from_millis(delay_ms.load(Ordering::Relaxed));
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            // The link's latency itself, not a synchronisation.
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
