//! pipec's own fabric over TCP, for launchers that start every process themselves and
//! give it torchrun's environment — `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
//! (`LOCAL_RANK` picks the GPU) — as torchrun, Kubernetes training operators and container
//! schedulers do. No MPI is needed.
//!
//! - **Rendezvous.** Rank 0 listens on `MASTER_PORT`; every other rank listens on a port of
//!   its own, connects to rank 0 and says its rank and port; rank 0 answers each with the
//!   address and port of every rank (the address each connection came from). Then each
//!   rank connects to the ranks below it and accepts the ranks above it: one connection
//!   per pair. Connections are retried until the start-up bound, so the processes may
//!   start in any order.
//! - **Messages.** A frame is the tag, the header's length, the number of values, the
//!   header and the values (little-endian). Each connection has a writer thread fed by a
//!   queue (posting returns at once, as the plan's verifier assumes) and a reader thread
//!   that files every frame under its (rank, tag), where receives wait for it.
//! - **Handshake.** Every connection opens with pipec's greeting (a magic number, the
//!   protocol's version, the rank, a nonce), answered by a challenge. A connection that does
//!   not greet (a port scan, a health check, an HTTP request) is closed with a note and the
//!   listener keeps waiting within the start-up bound. When `PIPEC_JOB_SECRET` is set (the
//!   same value in every process), both ends prove they know it — SHA-256 of the secret and
//!   the other end's nonce, so the secret never travels — and a peer that cannot is turned
//!   away: anyone who can reach `MASTER_PORT` could otherwise join the job and send it
//!   gradients.
//! - **Faults.** A connection that closes (its process ended or was killed) fails every
//!   receive from that rank at once, naming it; a rank that fails tells every other rank
//!   before it exits (an abort frame), and they stop too.

use std::collections::{HashMap, VecDeque};
use std::io::{BufWriter, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pipec_plan::DeviceId;

use crate::comm::fabric::Fabric;
use crate::comm::transport::TransportError;

/// A rank that fails sends this tag to every other before it exits.
const TAG_ABORT: i32 = -1;
const TAG_BARRIER: i32 = -2;
/// The largest header or value count a frame may announce (a corrupt length must not
/// allocate the machine's memory): 2³² values, 16 GiB.
const MAX_FRAME_ITEMS: u64 = 1 << 32;
/// PyTorch's default `MASTER_PORT`.
pub const DEFAULT_PORT: u16 = 29500;
/// The first bytes of every connection of pipec's fabric.
const MAGIC: &[u8; 8] = b"pipecTCP";
/// The rendezvous protocol's version: peers of another version are refused by name.
const PROTOCOL: u32 = 2;
/// How long a new connection may take to greet before it is closed as a stranger.
const GREETING: Duration = Duration::from_secs(5);
/// The variable that holds the job's shared secret.
pub const SECRET_VAR: &str = "PIPEC_JOB_SECRET";

/// Where a process is in its job, from torchrun's variables.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendezvous {
    pub rank: i32,
    pub size: i32,
    pub master: String,
    pub port: u16,
    /// `PIPEC_JOB_SECRET`, when the launcher sets one.
    pub secret: Option<String>,
}

impl Rendezvous {
    /// Reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR` (default 127.0.0.1) and `MASTER_PORT`
    /// (default 29500) through `var`.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Rendezvous, String> {
        let number = |name: &str| -> Result<i64, String> {
            let v = var(name).ok_or_else(|| {
                format!("`--transport tcp` takes its place in the job from torchrun's variables: {name} is not set (set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each process)")
            })?;
            v.trim().parse().map_err(|_| format!("{name} is `{v}`, not a whole number"))
        };
        let size = number("WORLD_SIZE")?;
        let rank = number("RANK")?;
        if !(1..=65_536).contains(&size) {
            return Err(format!("WORLD_SIZE is {size}: give the number of processes, 1 to 65536"));
        }
        if !(0..size).contains(&rank) {
            return Err(format!("RANK is {rank} but WORLD_SIZE is {size}: ranks run from 0 to {}", size - 1));
        }
        let master = var("MASTER_ADDR").filter(|m| !m.trim().is_empty()).unwrap_or_else(|| "127.0.0.1".into());
        let port = match var("MASTER_PORT") {
            None => DEFAULT_PORT,
            Some(p) => match p.trim().parse::<u16>() {
                Ok(0) => {
                    return Err(
                        "MASTER_PORT is 0: give the port rank 0 listens on, 1 to 65535 (every rank the same)".into()
                    )
                }
                Ok(port) => port,
                Err(_) => return Err(format!("MASTER_PORT is `{p}`, not a port number (1 to 65535)")),
            },
        };
        let secret = match var(SECRET_VAR) {
            Some(s) if s.is_empty() => {
                return Err(format!("{SECRET_VAR} is set but empty: give every rank the same secret, or unset it"))
            }
            other => other,
        };
        Ok(Rendezvous { rank: rank as i32, size: size as i32, master: master.trim().to_string(), port, secret })
    }

    /// [`Rendezvous::from_vars`] from this process's environment.
    pub fn from_env() -> Result<Rendezvous, String> {
        Rendezvous::from_vars(&|name| std::env::var(name).ok())
    }
}

/// What a writer thread is asked to do.
enum Frame {
    Data(i32, Vec<u8>, Option<Vec<f32>>),
    /// Answer once everything queued before has been written.
    Flush(Sender<()>),
}

/// A message's header and values.
type Received = (Vec<u8>, Vec<f32>);

/// What has arrived, by (rank, tag), and the ranks whose connection is gone (and why).
#[derive(Default)]
struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
}

#[derive(Default)]
struct InboxState {
    queues: HashMap<(i32, i32), VecDeque<Received>>,
    closed: HashMap<i32, String>,
}

impl Inbox {
    fn deliver(&self, rank: i32, tag: i32, message: Received) {
        if let Ok(mut s) = self.state.lock() {
            s.queues.entry((rank, tag)).or_default().push_back(message);
        }
        self.arrived.notify_all();
    }

    fn close(&self, rank: i32, why: String) {
        if let Ok(mut s) = self.state.lock() {
            s.closed.entry(rank).or_insert(why);
        }
        self.arrived.notify_all();
    }
}

/// One connection's sending side.
struct Link {
    queue: Sender<Frame>,
}

/// This process's connections to every other rank of the job.
pub struct TcpFabric {
    rank: i32,
    size: i32,
    links: HashMap<i32, Link>,
    inbox: Arc<Inbox>,
}

fn write_u32(w: &mut impl Write, v: u32) -> std::io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

// Values travel little-endian; on a little-endian machine that is their memory, written
// and read in place.
#[cfg(not(target_endian = "little"))]
compile_error!("the TCP fabric sends f32 values as their in-memory bytes, which assumes little-endian");

fn write_frame(w: &mut impl Write, tag: i32, bytes: &[u8], values: Option<&[f32]>) -> std::io::Result<()> {
    w.write_all(&tag.to_le_bytes())?;
    w.write_all(&(bytes.len() as u64).to_le_bytes())?;
    w.write_all(&(values.map_or(0, <[f32]>::len) as u64).to_le_bytes())?;
    w.write_all(bytes)?;
    w.write_all(bytemuck::cast_slice(values.unwrap_or_default()))
}

fn read_frame(r: &mut impl Read) -> std::io::Result<(i32, Vec<u8>, Vec<f32>)> {
    let mut t = [0u8; 4];
    r.read_exact(&mut t)?;
    let tag = i32::from_le_bytes(t);
    let (nbytes, nvalues) = (read_u64(r)?, read_u64(r)?);
    if nbytes > MAX_FRAME_ITEMS || nvalues > MAX_FRAME_ITEMS {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "a frame longer than any message"));
    }
    let mut bytes = vec![0u8; nbytes as usize];
    r.read_exact(&mut bytes)?;
    let mut values = vec![0f32; nvalues as usize];
    r.read_exact(bytemuck::cast_slice_mut(&mut values))?;
    Ok((tag, bytes, values))
}

/// Files every frame from `rank` until its connection ends.
fn read_loop(mut stream: TcpStream, rank: i32, inbox: &Inbox) {
    let mut reader = std::io::BufReader::with_capacity(1 << 16, &mut stream);
    loop {
        match read_frame(&mut reader) {
            Ok((TAG_ABORT, _, _)) => {
                inbox.close(rank, format!("rank {rank} failed and ended the job"));
                return;
            }
            Ok((tag, bytes, values)) => inbox.deliver(rank, tag, (bytes, values)),
            Err(e) => {
                // a process that ends with bytes unread in its socket resets the connection
                // (RST) instead of closing it (FIN): both mean the peer is gone
                let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    format!("rank {rank} closed its connection (its process ended)")
                } else if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                ) {
                    format!("rank {rank} closed its connection (reset: its process ended)")
                } else {
                    format!("the connection to rank {rank} failed: {e}")
                };
                inbox.close(rank, why);
                return;
            }
        }
    }
}

/// Writes every queued frame to `stream`, flushing whenever the queue is empty; once the
/// queue is closed, ends the connection's sending side (the peer reads its end). After a
/// failed write (the peer is gone; its reader says so) frames are dropped, and flushes
/// still answered.
fn write_loop(stream: TcpStream, rx: &Receiver<Frame>) {
    let mut w = BufWriter::with_capacity(1 << 16, stream);
    let mut ok = true;
    while let Ok(mut frame) = rx.recv() {
        loop {
            match frame {
                Frame::Data(tag, bytes, values) => {
                    ok = ok && write_frame(&mut w, tag, &bytes, values.as_deref()).is_ok();
                }
                Frame::Flush(ack) => {
                    ok = ok && w.flush().is_ok();
                    let _ = ack.send(());
                }
            }
            match rx.try_recv() {
                Ok(next) => frame = next,
                Err(_) => break,
            }
        }
        ok = ok && w.flush().is_ok();
    }
    let _ = w.flush();
    let _ = w.get_ref().shutdown(std::net::Shutdown::Write);
}

/// A new connection's rank and the port it listens on (0 between ranks other than 0).
struct Greeting {
    rank: i32,
    port: u16,
}

/// Why a new connection was not admitted.
enum Refused {
    /// Not a rank of this job (a stray connection, or one without the secret): noted, and
    /// the listener keeps waiting.
    Stranger(String),
    /// A pipec rank that can never join (another protocol version): the job cannot start.
    Fatal(String),
}

type Nonce = [u8; 16];

/// A fresh nonce from the operating system's generator (or, where that fails, the clock
/// and the process id, which still differ between connections).
fn nonce() -> Nonce {
    let mut n = [0u8; 16];
    if getrandom::getrandom(&mut n).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        n[..8].copy_from_slice(&(t as u64).to_le_bytes());
        n[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    n
}

/// What proves knowledge of the secret to the end that sent `nonce`: SHA-256 of the
/// secret, the prover's role and rank, and the nonce (zeros without a secret).
fn proof(secret: Option<&str>, role: &[u8], rank: i32, nonce: &Nonce) -> [u8; 32] {
    use sha2::Digest;
    let Some(secret) = secret else { return [0; 32] };
    let mut h = sha2::Sha256::new();
    h.update(secret.as_bytes());
    h.update([0]);
    h.update(role);
    h.update(rank.to_le_bytes());
    h.update(nonce);
    h.finalize().into()
}

fn read_array<const N: usize>(r: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// The connecting end's side of the handshake with `peer` (see the module's notes).
fn greet(s: &mut TcpStream, rank: i32, port: u16, secret: Option<&str>, peer: &str) -> Result<(), String> {
    let io = |e: std::io::Error| format!("the handshake with {peer} failed: {e}");
    s.set_read_timeout(Some(GREETING * 6)).map_err(io)?;
    let mine = nonce();
    let mut hello = MAGIC.to_vec();
    hello.extend(PROTOCOL.to_le_bytes());
    hello.extend((rank as u32).to_le_bytes());
    hello.extend(u32::from(port).to_le_bytes());
    hello.extend(mine);
    s.write_all(&hello).map_err(io)?;
    let magic: [u8; 8] = read_array(s).map_err(|e| format!("{peer} does not answer as a pipec rank: {e}"))?;
    if &magic != MAGIC {
        return Err(format!("{peer} does not speak pipec's rendezvous protocol (is something else listening there?)"));
    }
    let version = read_u32(s).map_err(io)?;
    if version != PROTOCOL {
        return Err(format!(
            "{peer} runs pipec's rendezvous protocol {version}, this rank {PROTOCOL}: run the same pipec on every rank"
        ));
    }
    let [needs] = read_array::<1>(s).map_err(io)?;
    let theirs: Nonce = read_array(s).map_err(io)?;
    let their_proof: [u8; 32] = read_array(s).map_err(io)?;
    match (needs != 0, secret) {
        (true, None) => {
            return Err(format!("{peer} requires the job's secret: set {SECRET_VAR} to the same value on every rank"))
        }
        (false, Some(_)) => {
            return Err(format!(
                "this rank has {SECRET_VAR} but {peer} does not use one: set the same secret on every rank, or on none"
            ))
        }
        (true, Some(_)) if their_proof != proof(secret, b"listener", rank, &mine) => {
            return Err(format!("{peer} does not know this job's secret ({SECRET_VAR} differs between the ranks)"))
        }
        _ => {}
    }
    s.write_all(&proof(secret, b"rank", rank, &theirs)).map_err(io)?;
    match read_array::<1>(s).map_err(io)? {
        [1] => Ok(()),
        _ => Err(format!("{peer} turned this rank away: the secret in {SECRET_VAR} is not the job's")),
    }
}

/// The listening end's side of the handshake with a new connection from `from`.
fn admit(s: &mut TcpStream, secret: Option<&str>, from: SocketAddr) -> Result<Greeting, Refused> {
    let stranger = |what: &str| Refused::Stranger(format!("closed a connection from {from} that {what}"));
    s.set_read_timeout(Some(GREETING)).map_err(|e| stranger(&format!("could not be read ({e})")))?;
    let magic: [u8; 8] = read_array(s).map_err(|_| stranger("did not greet as a pipec rank"))?;
    if &magic != MAGIC {
        return Err(stranger("does not speak pipec's rendezvous protocol"));
    }
    let hello = (|| -> std::io::Result<(u32, u32, u32, Nonce)> {
        Ok((read_u32(s)?, read_u32(s)?, read_u32(s)?, read_array(s)?))
    })();
    let (version, rank, port, theirs) = hello.map_err(|_| stranger("broke off its greeting"))?;
    let rank = rank as i32;
    let mine = nonce();
    let mut challenge = MAGIC.to_vec();
    challenge.extend(PROTOCOL.to_le_bytes());
    challenge.push(u8::from(secret.is_some()));
    challenge.extend(mine);
    challenge.extend(proof(secret, b"listener", rank, &theirs));
    s.write_all(&challenge).map_err(|_| stranger("left during the handshake"))?;
    if version != PROTOCOL {
        return Err(Refused::Fatal(format!(
            "the rank at {from} runs pipec's rendezvous protocol {version}, this rank {PROTOCOL}: run the same pipec on every rank"
        )));
    }
    let their_proof: [u8; 32] = read_array(s).map_err(|_| stranger("left during the handshake"))?;
    if secret.is_some() && their_proof != proof(secret, b"rank", rank, &mine) {
        let _ = s.write_all(&[0]);
        return Err(stranger(&format!("does not know the job's secret ({SECRET_VAR})")));
    }
    s.write_all(&[1]).map_err(|_| stranger("left during the handshake"))?;
    Ok(Greeting { rank, port: port as u16 })
}

/// Accepts connections on `listener` until one is admitted (a stranger is noted on stderr,
/// up to a few times, and the wait goes on) or `deadline` passes.
fn accept_rank(
    listener: &TcpListener,
    deadline: Instant,
    secret: Option<&str>,
    strangers: &mut usize,
    me: i32,
) -> Result<(TcpStream, SocketAddr, Greeting), String> {
    loop {
        let (mut s, from) = accept_until(listener, deadline)?;
        match admit(&mut s, secret, from) {
            Ok(g) => return Ok((s, from, g)),
            Err(Refused::Fatal(why)) => return Err(why),
            Err(Refused::Stranger(why)) => {
                *strangers += 1;
                if *strangers <= 5 {
                    eprintln!("note: rank {me}: {why}; still waiting for the job's ranks");
                }
            }
        }
    }
}

/// Connects to `addr` until it answers or `deadline` passes.
fn connect_until(addr: &str, port: u16, deadline: Instant) -> Result<TcpStream, String> {
    loop {
        let last = match (addr, port).to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                match addrs.iter().find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).ok()) {
                    Some(s) => return Ok(s),
                    None => format!("nothing answers at {addr}:{port}"),
                }
            }
            Err(e) => format!("cannot resolve {addr}: {e}"),
        };
        if Instant::now() > deadline {
            return Err(last);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Accepts one connection on `listener` before `deadline`.
fn accept_until(listener: &TcpListener, deadline: Instant) -> Result<(TcpStream, SocketAddr), String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    loop {
        match listener.accept() {
            Ok((s, a)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
                return Ok((s, a));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err("not every rank connected in time".into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

impl TcpFabric {
    /// Meets the job's other processes (see the module's notes) within `start`.
    pub fn connect(rv: &Rendezvous, start: Duration) -> Result<TcpFabric, String> {
        let deadline = Instant::now() + start;
        let (rank, size) = (rv.rank, rv.size);
        let secret = rv.secret.as_deref();
        let mut streams: HashMap<i32, TcpStream> = HashMap::new();
        if rank == 0 {
            let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, rv.port))
                .map_err(|e| format!("rank 0 cannot listen on port {} (MASTER_PORT): {e}", rv.port))?;
            let mut table: Vec<(IpAddr, u16)> = vec![(IpAddr::V4(Ipv4Addr::LOCALHOST), rv.port); size as usize];
            let mut strangers = 0;
            while streams.len() + 1 < size as usize {
                let (s, from, Greeting { rank: r, port }) = accept_rank(&listener, deadline, secret, &mut strangers, 0)
                    .map_err(|e| {
                        format!(
                            "rank 0: {e}: {} of {} ranks reached {}:{} within {} s",
                            streams.len() + 1,
                            size,
                            rv.master,
                            rv.port,
                            start.as_secs()
                        )
                    })?;
                if r <= 0 || r >= size || streams.contains_key(&r) {
                    return Err(format!("rank 0: a process from {from} says it is rank {r}: each of ranks 1 to {} must connect once (check RANK and WORLD_SIZE)", size - 1));
                }
                table[r as usize] = (from.ip(), port);
                streams.insert(r, s);
            }
            let mut text = String::new();
            for (ip, port) in &table {
                text.push_str(&format!("{ip} {port}\n"));
            }
            for s in streams.values_mut() {
                write_u32(s, text.len() as u32)
                    .map_err(|e| format!("{}: {e}", "rank 0: sending the ranks' addresses"))?;
                s.write_all(text.as_bytes()).map_err(|e| format!("{}: {e}", "rank 0: sending the ranks' addresses"))?;
            }
        } else {
            let listener =
                TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| format!("{}: {e}", "cannot listen"))?;
            let port = listener.local_addr().map_err(|e| format!("{}: {e}", "cannot listen"))?.port();
            let mut master = connect_until(&rv.master, rv.port, deadline).map_err(|e| {
                format!(
                    "rank {rank}: cannot reach rank 0 at {}:{} (MASTER_ADDR, MASTER_PORT) within {} s: {e}",
                    rv.master,
                    rv.port,
                    start.as_secs()
                )
            })?;
            let peer = format!("rank 0 at {}:{}", rv.master, rv.port);
            greet(&mut master, rank, port, secret, &peer).map_err(|e| format!("rank {rank}: {e}"))?;
            master.set_read_timeout(Some(start)).map_err(|e| format!("{}: {e}", "rank 0"))?;
            let n =
                read_u32(&mut master).map_err(|e| format!("{}: {e}", "waiting for rank 0's list of ranks"))? as usize;
            let mut text = vec![0u8; n.min(1 << 24)];
            master.read_exact(&mut text).map_err(|e| format!("{}: {e}", "reading rank 0's list of ranks"))?;
            let table: Vec<(String, u16)> = String::from_utf8_lossy(&text)
                .lines()
                .filter_map(|l| {
                    let (ip, port) = l.split_once(' ')?;
                    Some((ip.to_string(), port.parse().ok()?))
                })
                .collect();
            if table.len() != size as usize {
                return Err(format!("rank {rank}: rank 0 listed {} ranks, WORLD_SIZE says {size}", table.len()));
            }
            streams.insert(0, master);
            for (j, (ip, port)) in table.iter().enumerate().take(rank as usize).skip(1) {
                let mut s = connect_until(ip, *port, deadline)
                    .map_err(|e| format!("rank {rank}: cannot reach rank {j} at {ip}:{port}: {e}"))?;
                greet(&mut s, rank, 0, secret, &format!("rank {j} at {ip}:{port}"))
                    .map_err(|e| format!("rank {rank}: {e}"))?;
                streams.insert(j as i32, s);
            }
            let mut strangers = 0;
            while streams.len() < size as usize - 1 {
                let (s, _, Greeting { rank: j, .. }) = accept_rank(&listener, deadline, secret, &mut strangers, rank)
                    .map_err(|e| format!("rank {rank}: {e} (ranks above {rank})"))?;
                if j <= rank || j >= size || streams.contains_key(&j) {
                    return Err(format!("rank {rank}: a process says it is rank {j}, which should not connect here"));
                }
                streams.insert(j, s);
            }
        }
        let inbox = Arc::new(Inbox::default());
        let mut links = HashMap::new();
        for (r, s) in streams {
            s.set_nodelay(true).map_err(|e| format!("{}: {e}", "setting up a connection"))?;
            s.set_read_timeout(None).map_err(|e| format!("{}: {e}", "setting up a connection"))?;
            let reader = s.try_clone().map_err(|e| format!("{}: {e}", "setting up a connection"))?;
            let inbox_r = inbox.clone();
            std::thread::spawn(move || read_loop(reader, r, &inbox_r));
            let (queue, rx) = channel();
            std::thread::spawn(move || write_loop(s, &rx));
            links.insert(r, Link { queue });
        }
        Ok(TcpFabric { rank, size, links, inbox })
    }

    /// Waits until everything queued for every rank so far has been written, or `limit`.
    fn flush_within(&self, limit: Duration) {
        let acks: Vec<Receiver<()>> = self
            .links
            .values()
            .filter_map(|l| {
                let (tx, rx) = channel();
                l.queue.send(Frame::Flush(tx)).ok().map(|()| rx)
            })
            .collect();
        let deadline = Instant::now() + limit;
        for a in acks {
            let _ = a.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        }
    }
}

impl Fabric for TcpFabric {
    fn rank(&self) -> i32 {
        self.rank
    }
    fn size(&self) -> i32 {
        self.size
    }
    fn post(&self, dest: i32, tag: i32, bytes: Vec<u8>, values: Option<Vec<f32>>) -> Result<(), TransportError> {
        if dest == self.rank {
            self.inbox.deliver(dest, tag, (bytes, values.unwrap_or_default()));
            return Ok(());
        }
        let link = self.links.get(&dest).ok_or_else(|| TransportError::Other(format!("no rank {dest} in this job")))?;
        link.queue
            .send(Frame::Data(tag, bytes, values))
            .map_err(|_| TransportError::Other(format!("the connection to rank {dest} is closed")))
    }
    fn receive(
        &self,
        rank: i32,
        tag: i32,
        _values: bool,
        abort: &AtomicBool,
        timeout: Duration,
        from: DeviceId,
    ) -> Result<(Vec<u8>, Vec<f32>), TransportError> {
        let start = Instant::now();
        let mut s = self.inbox.state.lock().map_err(|_| TransportError::Other("the inbox is poisoned".into()))?;
        loop {
            if let Some(m) = s.queues.get_mut(&(rank, tag)).and_then(VecDeque::pop_front) {
                return Ok(m);
            }
            if let Some(why) = s.closed.get(&rank) {
                return Err(TransportError::Other(format!("nothing more can arrive from {from}: {why}")));
            }
            if abort.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(TransportError::Aborted);
            }
            if start.elapsed() > timeout {
                return Err(TransportError::Timeout { from, waited: start.elapsed() });
            }
            s = self
                .inbox
                .arrived
                .wait_timeout(s, Duration::from_millis(50))
                .map_err(|_| TransportError::Other("the inbox is poisoned".into()))?
                .0;
        }
    }
    fn barrier(&self) -> Result<(), TransportError> {
        let never = AtomicBool::new(false);
        let wait = Duration::from_secs(24 * 3600);
        let from = |r: i32| DeviceId(r as u32);
        if self.rank == 0 {
            for r in 1..self.size {
                self.receive(r, TAG_BARRIER, false, &never, wait, from(r))?;
            }
            for r in 1..self.size {
                self.post(r, TAG_BARRIER, Vec::new(), None)?;
            }
            self.flush_within(Duration::from_secs(60));
        } else {
            self.post(0, TAG_BARRIER, Vec::new(), None)?;
            self.receive(0, TAG_BARRIER, false, &never, wait, from(0))?;
        }
        Ok(())
    }
    fn flush(&self) {
        self.flush_within(Duration::from_secs(3600));
    }
    /// Tells every other rank, gives the frames two seconds to leave, and exits.
    fn abort(&self, code: i32) -> ! {
        for link in self.links.values() {
            let _ = link.queue.send(Frame::Data(TAG_ABORT, Vec::new(), None));
        }
        self.flush_within(Duration::from_secs(2));
        std::process::exit(code)
    }
}

#[cfg(test)]
mod tests;
