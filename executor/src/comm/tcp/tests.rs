use super::*;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| m.get(k).cloned()
}

#[test]
fn torchruns_variables_are_read_and_bad_ones_named() {
    let rv = Rendezvous::from_vars(&vars(&[("RANK", "2"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.1")]))
        .expect("reads");
    assert_eq!(rv, Rendezvous { rank: 2, size: 4, master: "10.0.0.1".into(), port: DEFAULT_PORT, secret: None });
    let e = |p: &[(&str, &str)]| Rendezvous::from_vars(&vars(p)).expect_err("refused");
    assert!(e(&[("RANK", "0")]).contains("WORLD_SIZE is not set"));
    assert!(e(&[("RANK", "4"), ("WORLD_SIZE", "4")]).contains("RANK is 4 but WORLD_SIZE is 4"));
    assert!(e(&[("RANK", "x"), ("WORLD_SIZE", "4")]).contains("RANK is `x`"));
    assert!(e(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")]).contains("MASTER_PORT"));
    assert!(e(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")]).contains("MASTER_PORT is 0"));
    assert!(e(&[("RANK", "0"), ("WORLD_SIZE", "2"), (SECRET_VAR, "")]).contains("empty"));
}

#[test]
fn frames_round_trip_and_a_huge_length_is_refused() {
    let mut b = Vec::new();
    write_frame(&mut b, 11, &[1, 2, 3], Some(&[0.5, -2.0])).expect("writes");
    write_frame(&mut b, 12, &[], None).expect("writes");
    let mut r = b.as_slice();
    assert_eq!(read_frame(&mut r).expect("reads"), (11, vec![1, 2, 3], vec![0.5, -2.0]));
    assert_eq!(read_frame(&mut r).expect("reads"), (12, vec![], vec![]));
    assert!(read_frame(&mut r).is_err());
    let mut huge = 10i32.to_le_bytes().to_vec();
    huge.extend(u64::MAX.to_le_bytes());
    huge.extend(0u64.to_le_bytes());
    assert!(read_frame(&mut huge.as_slice()).is_err());
}

#[test]
fn three_ranks_meet_exchange_messages_in_order_and_see_a_peer_leave() {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("port").local_addr().expect("addr").port();
    let fabrics: Vec<TcpFabric> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                s.spawn(move || {
                    let rv = Rendezvous { rank, size: 3, master: "127.0.0.1".into(), port, secret: None };
                    TcpFabric::connect(&rv, Duration::from_secs(20)).expect("connects")
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("joined")).collect()
    });
    let never = AtomicBool::new(false);
    let t = Duration::from_secs(10);
    for (i, f) in fabrics.iter().enumerate() {
        for (j, _) in fabrics.iter().enumerate().filter(|(j, _)| *j != i) {
            for k in 0..3 {
                f.post(j as i32, 11, vec![i as u8, k], Some(vec![k as f32; 1000])).expect("posts");
            }
        }
    }
    for (i, f) in fabrics.iter().enumerate() {
        for j in (0..3).filter(|j| *j != i) {
            for k in 0..3u8 {
                let (b, v) = f.receive(j as i32, 11, true, &never, t, DeviceId(j as u32)).expect("arrives");
                assert_eq!((b, v), (vec![j as u8, k], vec![f32::from(k); 1000]));
            }
        }
    }
    std::thread::scope(|s| {
        for f in &fabrics {
            s.spawn(move || f.barrier().expect("barrier"));
        }
    });
    // rank 2 goes: a receive from it fails at once, naming it
    let mut fabrics = fabrics;
    let gone = fabrics.pop().expect("rank 2");
    drop(gone);
    let start = Instant::now();
    let e = fabrics[0].receive(2, 11, true, &never, t, DeviceId(2)).expect_err("gone");
    assert!(e.to_string().contains("rank 2"), "{e}");
    assert!(start.elapsed() < t, "noticed at once, not at the timeout");
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("port").local_addr().expect("addr").port()
}

/// Ranks 0..n meeting on `port` with each its secret (in threads).
fn meet(port: u16, secrets: &[Option<&str>], bound: u64) -> Vec<Result<TcpFabric, String>> {
    let size = secrets.len() as i32;
    std::thread::scope(|s| {
        let handles: Vec<_> = secrets
            .iter()
            .enumerate()
            .map(|(rank, secret)| {
                s.spawn(move || {
                    let rv = Rendezvous {
                        rank: rank as i32,
                        size,
                        master: "127.0.0.1".into(),
                        port,
                        secret: secret.map(str::to_string),
                    };
                    TcpFabric::connect(&rv, Duration::from_secs(bound))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("joined")).collect()
    })
}

#[test]
fn stray_connections_to_the_master_port_are_closed_and_the_job_still_meets() {
    let port = free_port();
    let strays = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(5);
        // connect-and-close, an HTTP request and a slow silent client, before rank 1 comes
        let mut quiet = None;
        while Instant::now() < deadline && quiet.is_none() {
            if let Ok(s) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)) {
                drop(s);
                let mut http = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect("http");
                let _ = http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
                quiet = Some(TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect("quiet"));
            } else {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        quiet
    });
    // rank 0 starts at once; ranks 1 and 2 a moment later, after the strays
    let rank0 = std::thread::spawn(move || {
        let rv = Rendezvous { rank: 0, size: 3, master: "127.0.0.1".into(), port, secret: None };
        TcpFabric::connect(&rv, Duration::from_secs(20))
    });
    let _quiet = strays.join().expect("strays");
    std::thread::sleep(Duration::from_millis(200));
    let others: Vec<_> = (1..3)
        .map(|rank| {
            std::thread::spawn(move || {
                let rv = Rendezvous { rank, size: 3, master: "127.0.0.1".into(), port, secret: None };
                TcpFabric::connect(&rv, Duration::from_secs(20))
            })
        })
        .collect();
    let mut all = vec![rank0.join().expect("rank 0").expect("rank 0 meets the others")];
    all.extend(others.into_iter().map(|h| h.join().expect("joined").expect("meets")));
    let never = AtomicBool::new(false);
    all[2].post(0, 11, vec![7], Some(vec![1.5])).expect("posts");
    let got = all[0].receive(2, 11, true, &never, Duration::from_secs(10), DeviceId(2)).expect("arrives");
    assert_eq!(got, (vec![7], vec![1.5]));
}

#[test]
fn with_a_secret_only_ranks_that_know_it_join() {
    let good = meet(free_port(), &[Some("s3cret"), Some("s3cret"), Some("s3cret")], 20);
    assert!(good.iter().all(Result::is_ok), "{:?}", good.iter().filter_map(|r| r.as_ref().err()).collect::<Vec<_>>());
    // rank 1 without the secret: it is told what to set; rank 0 waits on and ends at its bound
    let port = free_port();
    let r = meet(port, &[Some("s3cret"), None], 2);
    let e1 = r[1].as_ref().err().expect("rank 1 refused");
    assert!(e1.contains("requires the job's secret") && e1.contains(SECRET_VAR), "{e1}");
    assert!(r[0].is_err());
    // a wrong secret: both ends see it
    let r = meet(free_port(), &[Some("s3cret"), Some("guess")], 2);
    let e1 = r[1].as_ref().err().expect("rank 1 refused");
    assert!(e1.contains("does not know this job's secret"), "{e1}");
    // a secret on a rank only
    let r = meet(free_port(), &[None, Some("s3cret")], 2);
    let e1 = r[1].as_ref().err().expect("rank 1 refused");
    assert!(e1.contains("does not use one"), "{e1}");
}

#[test]
fn the_proof_depends_on_the_secret_the_role_the_rank_and_the_nonce() {
    let n = nonce();
    let p = proof(Some("a"), b"rank", 1, &n);
    assert_ne!(p, proof(Some("b"), b"rank", 1, &n));
    assert_ne!(p, proof(Some("a"), b"listener", 1, &n));
    assert_ne!(p, proof(Some("a"), b"rank", 2, &n));
    assert_ne!(p, proof(Some("a"), b"rank", 1, &nonce()));
    assert_eq!(proof(None, b"rank", 1, &n), [0; 32]);
}
