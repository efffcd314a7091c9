use super::in_process::connect;
use super::*;
use pipec_plan::{MicrobatchId, StageId};

#[test]
fn ring_and_ps_all_reduce_sum_identically_on_every_member() {
    for algorithm in [ReduceMode::Ring, ReduceMode::ParameterServer] {
        for p in 1..=5usize {
            let results = run_collective(CollectiveKind::AllReduce, p, algorithm, |i| {
                (0..7).map(|k| (i * 10 + k) as f32).collect()
            });
            let expected: Vec<f32> = (0..7).map(|k| (0..p).map(|i| (i * 10 + k) as f32).sum()).collect();
            for r in &results {
                assert_eq!(r, &expected, "{algorithm:?} p={p}");
            }
        }
    }
}

/// Runs `kind` on `p` in-process members, member i contributing `input(i)`.
fn run_collective(
    kind: CollectiveKind,
    p: usize,
    algorithm: ReduceMode,
    input: impl Fn(usize) -> Vec<f32>,
) -> Vec<Vec<f32>> {
    run_summing(kind, p, algorithm, None, input)
}

/// [`run_collective`] rounding its sums by `sum`.
fn run_summing(
    kind: CollectiveKind,
    p: usize,
    algorithm: ReduceMode,
    sum: Option<Rounding>,
    input: impl Fn(usize) -> Vec<f32>,
) -> Vec<Vec<f32>> {
    let devices: Vec<DeviceId> = (0..p as u32).map(DeviceId).collect();
    let eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_secs(10));
    let handles: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(i, mut ep)| {
            let (group, data) = (devices.clone(), input(i));
            std::thread::spawn(move || ep.collective(kind, &group, data, algorithm, sum))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("thread").expect("collective")).collect()
}

/// A bf16 or fp16 sum rounds every member's values and every partial sum to that type,
/// in the ring's order: chunk c is x_c, then + x_{c+1}, … + x_{c−1}, each rounded; the
/// parameter server adds the members in order. Only the first `values` values round
/// (the batch statistics after a stage's gradients add in fp32). The result differs from
/// the fp32 sum rounded once, and the reduce-scatter is the all-reduce's chunk, bit for
/// bit.
#[test]
fn a_reduction_in_bf16_or_fp16_rounds_each_partial_sum_in_ring_order() {
    let (p, n, values) = (3usize, 9usize, 7usize);
    // values just above 1 whose partial sums fall between bf16's and fp16's steps
    let input = |i: usize| (0..n).map(|k| 1.0 + (i * 7 + k * 3 + 1) as f32 * 1e-3).collect::<Vec<f32>>();
    for precision in [Precision::Bf16, Precision::Fp16] {
        let round = Rounding::of(precision, values, n).expect("a low precision rounds");
        let r = |k: usize, x: f32| if k < values { (round.to)(x) } else { x };
        let ring: Vec<f32> = (0..n)
            .map(|k| {
                let c = (0..p).find(|&c| chunk(n, p, c).contains(&k)).expect("a chunk");
                (1..p).fold(r(k, input(c)[k]), |acc, j| r(k, r(k, input((c + j) % p)[k]) + acc))
            })
            .collect();
        let all = run_summing(CollectiveKind::AllReduce, p, ReduceMode::Ring, Some(round), input);
        assert!(all.iter().all(|a| a == &ring), "{precision}: {all:?} vs {ring:?}");
        let once: Vec<f32> = (0..values).map(|k| (round.to)((0..p).map(|i| input(i)[k]).sum())).collect();
        assert_ne!(ring[..values], once, "{precision}: the rounding of each partial sum shows");
        let exact = run_collective(CollectiveKind::AllReduce, p, ReduceMode::Ring, input);
        assert_eq!(ring[values..], exact[0][values..], "{precision}: the statistics add in fp32");
        let scattered = run_summing(CollectiveKind::ReduceScatter, p, ReduceMode::Ring, Some(round), input);
        for (i, part) in scattered.iter().enumerate() {
            assert_eq!(part.as_slice(), &ring[chunk(n, p, i)], "{precision} member {i}");
        }
        let server: Vec<f32> =
            (0..n).map(|k| (1..p).fold(r(k, input(0)[k]), |acc, i| r(k, acc + r(k, input(i)[k])))).collect();
        let ps = run_summing(CollectiveKind::AllReduce, p, ReduceMode::ParameterServer, Some(round), input);
        assert!(ps.iter().all(|a| a == &server), "{precision}: {ps:?} vs {server:?}");
    }
    assert!(Rounding::of(Precision::Fp32, n, n).is_none(), "fp32 adds exactly");
    // segments: every third value is a statistic
    let round = Rounding::of(Precision::Bf16, 2, 3).expect("bf16");
    let x = 1.001f32;
    let kept: Vec<bool> = (0..6).map(|i| round.at(i, x) == x).collect();
    assert_eq!(kept, [false, false, true, false, false, true]);
}

#[test]
fn reduce_scatter_then_all_gather_is_the_all_reduce_bit_for_bit() {
    for p in 1..=5usize {
        for n in [1usize, 7, 10, 64] {
            // values whose sums depend on their order, so the order is checked too
            let input = |i: usize| (0..n).map(|k| 1.0 / ((i * 31 + k * 7 + 3) as f32)).collect::<Vec<f32>>();
            let all = run_collective(CollectiveKind::AllReduce, p, ReduceMode::Ring, input);
            let scattered = run_collective(CollectiveKind::ReduceScatter, p, ReduceMode::Ring, input);
            for (i, part) in scattered.iter().enumerate() {
                assert_eq!(part.as_slice(), &all[i][chunk(n, p, i)], "p={p} n={n} member {i}");
            }
            let gathered = run_collective(CollectiveKind::AllGather, p, ReduceMode::Ring, |i| scattered[i].clone());
            for g in &gathered {
                assert_eq!(g, &all[0], "p={p} n={n}");
            }
        }
    }
}

#[test]
fn all_to_all_hands_every_member_the_chunks_addressed_to_it() {
    for p in 1..=5usize {
        // member i's chunk for member j holds 100·i + 10·j + k
        let n = 3 * p;
        let input = |i: usize| (0..n).map(|x| (100 * i + 10 * (x / 3) + x % 3) as f32).collect::<Vec<f32>>();
        let out = run_collective(CollectiveKind::AllToAll, p, ReduceMode::Ring, input);
        for (j, got) in out.iter().enumerate() {
            let expected: Vec<f32> = (0..p).flat_map(|i| (0..3).map(move |k| (100 * i + 10 * j + k) as f32)).collect();
            assert_eq!(got, &expected, "p={p} member {j}");
        }
        // twice is the identity: what came back is every member's own input
        let back = run_collective(CollectiveKind::AllToAll, p, ReduceMode::Ring, |j| out[j].clone());
        for (i, b) in back.iter().enumerate() {
            assert_eq!(b, &input(i), "p={p} member {i}");
        }
    }
}

#[test]
fn an_exchange_moves_chunks_of_any_size_including_none() {
    let p = 3usize;
    let devices: Vec<DeviceId> = (0..p as u32).map(DeviceId).collect();
    let eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_secs(10));
    // member i sends member j a chunk of (i + 2j) mod 3 values, each 10·i + j
    let chunk_of = |i: usize, j: usize| vec![(10 * i + j) as f32; (i + 2 * j) % 3];
    let handles: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(i, mut ep)| {
            let group = devices.clone();
            let chunks: Vec<Vec<f32>> = (0..p).map(|j| chunk_of(i, j)).collect();
            std::thread::spawn(move || ep.all_to_all_v(&group, chunks))
        })
        .collect();
    for (j, h) in handles.into_iter().enumerate() {
        let got = h.join().expect("thread").expect("exchange");
        assert_eq!(got, (0..p).map(|i| chunk_of(i, j)).collect::<Vec<_>>(), "member {j}");
    }
}

#[test]
fn receive_times_out_instead_of_hanging() {
    let devices = [DeviceId(0), DeviceId(1)];
    let mut eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_millis(200));
    let err = eps[0].recv(DeviceId(1), Tag::activation(StageId(0), MicrobatchId(0))).expect_err("nothing was sent");
    assert!(matches!(err, TransportError::Timeout { .. }));
}
