//! `hyper-floor LISTEN UPSTREAM`: the least a proxy built on hyper can do per request.
//!
//! Each client connection gets one upstream connection, and every request is sent on it as it
//! came (origin-form target, client headers, streaming body) and answered with the upstream's
//! response as it came. No route, token, header rewriting, hop-by-hop stripping, timer, metric
//! or log: fencegate does all of those on top of hyper's HTTP/1 server (through hyper-util's
//! HTTP/1+2 builder) and client, with the same runtime (one thread), allocator and flat-buffer
//! writes. So fencegate's cost minus this one's is fencegate's own work, and this one's minus
//! nginx's is what hyper costs over nginx.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream), None) = (args.next(), args.next(), args.next()) else {
        return Err(
            "usage: hyper-floor LISTEN_ADDR UPSTREAM_ADDR (e.g. 127.0.0.1:8081 127.0.0.1:8080)"
                .into(),
        );
    };
    let listen: SocketAddr = listen.parse()?;
    let upstream: SocketAddr = upstream.parse()?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(accept(listen, upstream))
}

async fn accept(listen: SocketAddr, upstream: SocketAddr) -> Result<(), BoxError> {
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (client, _) = listener.accept().await?;
        tokio::spawn(async move {
            if let Err(e) = serve(client, upstream).await {
                eprintln!("connection ended: {e}");
            }
        });
    }
}

async fn serve(client: TcpStream, upstream: SocketAddr) -> Result<(), BoxError> {
    client.set_nodelay(true)?;
    let stream = TcpStream::connect(upstream).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .writev(false)
        .handshake::<_, Incoming>(TokioIo::new(stream))
        .await?;
    tokio::spawn(connection);
    // Requests on one HTTP/1 connection come one after another, so the lock is never contended.
    let sender: Arc<Mutex<SendRequest<Incoming>>> = Arc::new(Mutex::new(sender));
    let service = service_fn(move |req: Request<Incoming>| {
        let sender = Arc::clone(&sender);
        async move {
            poll_fn(|cx| sender.lock().expect("not poisoned").poll_ready(cx)).await?;
            let response = sender.lock().expect("not poisoned").send_request(req);
            response.await
        }
    });
    hyper::server::conn::http1::Builder::new()
        .writev(false)
        .serve_connection(TokioIo::new(client), service)
        .await?;
    Ok(())
}
