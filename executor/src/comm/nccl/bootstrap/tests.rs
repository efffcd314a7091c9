use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use super::*;
use crate::comm::tcp::{Rendezvous, TcpFabric};

/// A stand-in for NCCL: like NCCL's, a rank's part is ready only once every rank has
/// started its own, so a rank that fails or never starts leaves the others pending.
struct Fake {
    ranks: usize,
    id: UniqueId,
    /// rank 0 cannot make an id
    no_id: bool,
    /// this rank's start fails at once
    fail_start: Option<usize>,
    /// this rank's part fails while starting
    fail_later: Option<usize>,
    /// this rank's start hangs for this long, then fails (a rank stuck inside NCCL)
    hang: Option<(usize, Duration)>,
    started: Mutex<Vec<(usize, UniqueId)>>,
    aborted: Mutex<Vec<usize>>,
}

impl Fake {
    fn new(ranks: usize) -> Fake {
        let mut id = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 37 + 11) as u8;
        }
        Fake {
            ranks,
            id,
            no_id: false,
            fail_start: None,
            fail_later: None,
            hang: None,
            started: Mutex::default(),
            aborted: Mutex::default(),
        }
    }
}

impl Fake {
    /// The ranks that started a part, and those whose part was aborted, each sorted.
    fn started_and_aborted(&self) -> (Vec<usize>, Vec<usize>) {
        let mut started: Vec<usize> = self.started.lock().expect("lock").iter().map(|(r, _)| *r).collect();
        let mut aborted = self.aborted.lock().expect("lock").clone();
        started.sort_unstable();
        aborted.sort_unstable();
        (started, aborted)
    }
}

impl Nccl for Fake {
    type Comm = usize;
    fn unique_id(&self) -> Result<UniqueId, String> {
        if self.no_id {
            Err("no network interface for NCCL's bootstrap".into())
        } else {
            Ok(self.id)
        }
    }
    fn start(&self, id: &UniqueId, ranks: usize, rank: usize) -> Result<usize, String> {
        assert_eq!(ranks, self.ranks);
        if self.fail_start == Some(rank) {
            return Err("unhandled cuda error (run with NCCL_DEBUG=INFO for details)".into());
        }
        if let Some((r, t)) = self.hang.filter(|(r, _)| *r == rank) {
            std::thread::sleep(t);
            return Err(format!("rank {r} hung"));
        }
        self.started.lock().expect("lock").push((rank, *id));
        Ok(rank)
    }
    fn progress(&self, comm: &usize) -> Progress {
        if self.fail_later == Some(*comm) {
            return Progress::Failed("remote process exited or there was a network error".into());
        }
        if self.started.lock().expect("lock").len() == self.ranks {
            Progress::Ready
        } else {
            Progress::Pending
        }
    }
    fn abort(&self, comm: usize) {
        self.aborted.lock().expect("lock").push(comm);
    }
}

fn fabrics(size: i32) -> Vec<TcpFabric> {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("port").local_addr().expect("addr").port();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                s.spawn(move || {
                    let rv = Rendezvous { rank, size, master: "127.0.0.1".into(), port, secret: None };
                    TcpFabric::connect(&rv, Duration::from_secs(20)).expect("connects")
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("joined")).collect()
    })
}

/// Each rank's outcome (None: the rank stayed silent) and the seconds it took.
fn run(fake: &Fake, size: i32, silent: Option<i32>, timeout: Duration) -> Vec<(Option<Result<usize, String>>, f64)> {
    run_with(fake, size, silent, &[], timeout)
}

/// [`run`], the `odd` rank sending `says` on the start's tag (rank 0 to every rank, another
/// rank to rank 0) instead of starting, then staying silent.
fn run_with(
    fake: &Fake,
    size: i32,
    odd: Option<i32>,
    says: &[u8],
    timeout: Duration,
) -> Vec<(Option<Result<usize, String>>, f64)> {
    let fabrics = fabrics(size);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let handles: Vec<_> = fabrics
            .iter()
            .map(|f| {
                let done = &done;
                s.spawn(move || {
                    let t = Instant::now();
                    if odd == Some(f.rank()) {
                        let to: Vec<i32> = if f.rank() == 0 { (1..size).collect() } else { vec![0] };
                        for r in to.into_iter().filter(|_| !says.is_empty()) {
                            f.post(r, TAG_NCCL, says.to_vec(), None).expect("posts");
                        }
                        // alive, connected, and saying nothing (more) until the others have ended
                        while !done.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                        return (None, t.elapsed().as_secs_f64());
                    }
                    (Some(start(fake, f, timeout)), t.elapsed().as_secs_f64())
                })
            })
            .collect();
        // the silent rank's thread is joined by the scope, once `done` is set
        let out = handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| if odd == Some(r as i32) { (None, 0.0) } else { h.join().expect("joined") })
            .collect();
        done.store(true, Ordering::Relaxed);
        out
    })
}

#[test]
fn every_rank_starts_its_part_with_rank_0s_id_byte_for_byte() {
    let fake = Fake::new(4);
    let out = run(&fake, 4, None, Duration::from_secs(30));
    for (r, (o, _)) in out.iter().enumerate() {
        assert_eq!(o, &Some(Ok(r)), "rank {r}");
    }
    let (ranks, aborted) = fake.started_and_aborted();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
    assert!(fake.started.lock().expect("lock").iter().all(|(_, id)| *id == fake.id), "every rank used rank 0's id");
    assert!(aborted.is_empty());
}

#[test]
fn a_failure_on_one_rank_stops_every_rank_at_once_and_aborts_every_part() {
    for (fail_start, fail_later) in [(Some(2), None), (None, Some(1)), (None, Some(0)), (Some(0), None)] {
        let mut fake = Fake::new(4);
        fake.fail_start = fail_start;
        fake.fail_later = fail_later;
        let bad = fail_start.or(fail_later).expect("a failing rank");
        // a long timeout: the failure, not the timeout, must end the wait
        let out = run(&fake, 4, None, Duration::from_secs(60));
        for (r, (o, secs)) in out.iter().enumerate() {
            let e = o.clone().expect("ran").expect_err("every rank stops");
            assert!(*secs < 15.0, "rank {r} took {secs:.1} s");
            assert!(e.contains(&format!("rank {bad}")) || r == bad, "rank {r}: {e}");
        }
        // every part that was started is aborted, on every rank
        let (started, aborted) = fake.started_and_aborted();
        assert_eq!(started, aborted, "failing rank {bad}");
    }
}

#[test]
fn without_an_id_every_rank_stops_with_rank_0s_reason() {
    let mut fake = Fake::new(3);
    fake.no_id = true;
    let out = run(&fake, 3, None, Duration::from_secs(30));
    for (o, _) in &out {
        let e = o.clone().expect("ran").expect_err("stops");
        assert!(e.contains("unique id on rank 0: no network interface"), "{e}");
    }
    assert!(fake.started.lock().expect("lock").is_empty());
}

#[test]
fn a_silent_rank_stops_every_other_rank_within_the_timeout() {
    let timeout = Duration::from_millis(1500);
    for silent in [3, 0] {
        let fake = Fake::new(4);
        let out = run(&fake, 4, Some(silent), timeout);
        for (r, (o, secs)) in out.iter().enumerate() {
            if r as i32 == silent {
                continue;
            }
            let e = o.clone().expect("ran").expect_err("stops");
            assert!(*secs < 10.0, "rank {r} took {secs:.1} s");
            let named = if silent == 0 {
                "rank 0 said nothing of NCCL's start within 1.5 s"
            } else {
                "rank(s) 3 said nothing; rank(s) 0, 1, 2 started their part and it did not finish within 1.5 s"
            };
            assert!(e.contains(named), "rank {r}: {e}");
        }
        let (started, aborted) = fake.started_and_aborted();
        assert_eq!(started, aborted, "silent rank {silent}");
    }
}

#[test]
fn ranks_whose_rank_0_hangs_after_sending_the_id_stop_on_their_own() {
    let timeout = Duration::from_millis(1000);
    let mut fake = Fake::new(3);
    // rank 0 sends the id, then hangs inside NCCL past everyone's patience
    fake.hang = Some((0, timeout + GRACE + Duration::from_secs(3)));
    let out = run(&fake, 3, None, timeout);
    for (r, (o, secs)) in out.iter().enumerate().skip(1) {
        let e = o.clone().expect("ran").expect_err("stops");
        assert!(e.contains("did not start within 6 s, and rank 0 gave no verdict"), "rank {r}: {e}");
        assert!(*secs < (timeout + GRACE).as_secs_f64() + 5.0, "rank {r} took {secs:.1} s");
    }
    // ranks 1 and 2 started their parts and aborted them
    assert_eq!(fake.started_and_aborted().1, vec![1, 2]);
}

#[test]
fn a_malformed_message_or_another_id_stops_every_rank_and_names_its_sender() {
    let timeout = Duration::from_secs(30);
    // another rank's report that is none of the start's messages
    let fake = Fake::new(3);
    let out = run_with(&fake, 3, Some(2), &[9, 9, 9], timeout);
    for (r, (o, secs)) in out.iter().enumerate().take(2) {
        let e = o.clone().expect("ran").expect_err("stops");
        assert!(e.contains("rank 2: its report of NCCL's start is malformed"), "rank {r}: {e}");
        assert!(*secs < 15.0, "rank {r} took {secs:.1} s");
    }
    // a rank whose part is ready with an id other than rank 0's (its digest differs)
    let fake = Fake::new(3);
    let mut wrong = vec![READY];
    wrong.extend(digest(&[7u8; UNIQUE_ID_BYTES]));
    let out = run_with(&fake, 3, Some(2), &wrong, timeout);
    for (r, (o, _)) in out.iter().enumerate().take(2) {
        let e = o.clone().expect("ran").expect_err("stops");
        assert!(e.contains("rank 2: it started NCCL with another unique id than rank 0 sent"), "rank {r}: {e}");
    }
    // rank 0's id cut short, and a message that is not an id
    for says in [&[0u8; 17][..], &[GO][..]] {
        let fake = Fake::new(3);
        let out = run_with(&fake, 3, Some(0), says, timeout);
        for (r, (o, _)) in out.iter().enumerate().skip(1) {
            let e = o.clone().expect("ran").expect_err("stops");
            assert!(e.contains("rank 0's NCCL unique id is malformed"), "rank {r}: {e}");
        }
        assert!(fake.started.lock().expect("lock").is_empty());
    }
}
