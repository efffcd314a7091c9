//! The link between the executor's workers as a calibration measures it: point-to-point
//! messages and all-reduces timed over the in-process transport, and the link fitted to them.

use super::*;

/// What a calibration measured of the transport between the executor's workers.
#[derive(Debug, Clone)]
pub struct LinkCalibration {
    /// The workers the all-reduces ran over.
    pub devices: usize,
    /// Point-to-point messages between two workers: bytes and one-way seconds.
    pub p2p: Vec<Point>,
    /// Ring all-reduces over `devices` workers: bytes per member and seconds.
    pub all_reduce: Vec<Point>,
    pub link: pipec_plan::device::MeasuredLink,
}

/// Values per message of the link sweep (4 KiB to 32 MiB).
const LINK_SIZES: &[usize] = &[1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23];

/// Measures the in-process transport `pipec run` uses between its worker threads (the
/// same channels and the same ring all-reduce, `transport::ring_all_reduce`):
/// point-to-point messages by ping-pong between two workers, then ring all-reduces over
/// `devices` workers of a gradient as the executor reduces one (read back from the CPU
/// backend, summed, made a tensor again), each the median of `reps` (every member's time,
/// the slowest counted). The link: the messages' line (latency, bandwidth), and the efficiency that
/// makes the cost model's ring formula give the all-reduces' measured bus bandwidth.
pub fn calibrate_links(devices: usize, reps: usize) -> LinkCalibration {
    use crate::comm::transport::{in_process, Endpoint};
    use pipec_plan::{vocab::ReduceMode, CollectiveKind, DeviceId};
    let devices = devices.max(2);
    let reps = reps.max(3);
    let ids: Vec<DeviceId> = (0..devices as u32).map(DeviceId).collect();
    let connect = || in_process::connect(&ids, Default::default(), std::time::Duration::from_secs(120)).into_iter();
    // one-way time of a message: half a round trip
    let p2p: Vec<Point> = LINK_SIZES
        .iter()
        .map(|&n| {
            let mut eps = connect();
            let (mut a, mut b) = (eps.next().expect("two endpoints"), eps.next().expect("two endpoints"));
            // the two ends each on a core of their own, as the run's workers are
            // (`run::affinity`)
            let echo = std::thread::spawn(move || {
                crate::run::affinity::pin(1, 2);
                for _ in 0..reps + 1 {
                    let Ok(v) = b.coll_recv(DeviceId(0)) else { return };
                    if b.coll_send(DeviceId(0), v).is_err() {
                        return;
                    }
                }
            });
            // the messages made before the timing: a send moves what the worker computed
            let mut pool: Vec<Vec<f32>> = (0..reps + 1).map(|_| vec![1.0f32; n]).collect();
            let timing = std::thread::spawn(move || {
                crate::run::affinity::pin(0, 2);
                median_seconds(1, reps, || {
                    let payload = pool.pop().unwrap_or_default();
                    if a.coll_send(DeviceId(1), payload).is_ok() {
                        let _ = a.coll_recv(DeviceId(1));
                    }
                }) / 2.0
            });
            let seconds = timing.join().unwrap_or(f64::NAN);
            let _ = echo.join();
            Point { size: (n * 4) as f64, seconds }
        })
        .collect();
    let all_reduce: Vec<Point> = LINK_SIZES
        .iter()
        .map(|&n| {
            let barrier = std::sync::Barrier::new(devices);
            let times: Vec<f64> = std::thread::scope(|s| {
                let handles: Vec<_> = connect()
                    .enumerate()
                    .map(|(i, mut ep)| {
                        let (ids, barrier) = (&ids, &barrier);
                        s.spawn(move || {
                            crate::run::affinity::pin(i, devices);
                            // every member starts each one together, on a gradient as the
                            // executor holds it: read back from the backend, summed, made a
                            // tensor again
                            let dev = Default::default();
                            let grad = Tensor::<burn::backend::Flex, 1>::ones([n], &dev);
                            let mut t: Vec<f64> = (0..=reps)
                                .map(|_| {
                                    barrier.wait();
                                    let start = Instant::now();
                                    let data =
                                        crate::nn::params::host_f32(grad.clone().into_data()).unwrap_or_default();
                                    if let Ok(sum) =
                                        ep.collective(CollectiveKind::AllReduce, ids, data, ReduceMode::Ring, None)
                                    {
                                        let back = Tensor::<burn::backend::Flex, 1>::from_data(
                                            burn::tensor::TensorData::new(sum, [n]),
                                            &dev,
                                        );
                                        std::hint::black_box(back);
                                    }
                                    start.elapsed().as_secs_f64()
                                })
                                .skip(1)
                                .collect();
                            t.sort_by(f64::total_cmp);
                            t[t.len() / 2]
                        })
                    })
                    .collect();
                handles.into_iter().filter_map(|h| h.join().ok()).collect()
            });
            Point { size: (n * 4) as f64, seconds: times.into_iter().fold(0.0, f64::max) }
        })
        .collect();
    LinkCalibration { devices, link: fit_link(&p2p, &all_reduce, devices), p2p, all_reduce }
}

/// The link of [`calibrate_links`]' points: the messages' line gives the latency and the
/// bandwidth (the largest message's rate where the line is flat); the largest all-reduce
/// gives the bus bandwidth — its `2(p−1)/p · bytes` over its time less the ring's
/// `2(p−1)` latencies — whose share of the bandwidth is the efficiency (the bandwidth
/// raised to the bus bandwidth where it is the larger). The largest, not a line through
/// all: on a CPU the all-reduces leave the caches as they grow (an 8 MiB one ran at 2.5×
/// the rate of a 32 MiB one here), and the reductions that matter are the gradients'.
pub fn fit_link(p2p: &[Point], all_reduce: &[Point], devices: usize) -> pipec_plan::device::MeasuredLink {
    let largest_rate = |ps: &[Point]| ps.last().map_or(1e9, |p| p.size / p.seconds.max(1e-12));
    let (bandwidth, latency) = match fit_line(p2p) {
        Some((slope, intercept)) if slope > 0.0 => (1.0 / slope, intercept.max(0.0)),
        _ => (largest_rate(p2p), p2p.first().map_or(0.0, |p| p.seconds)),
    };
    let p = devices.max(2) as f64;
    let bus = all_reduce
        .iter()
        .max_by(|a, b| a.size.total_cmp(&b.size))
        .map(|q| {
            let wire = (q.seconds - 2.0 * (p - 1.0) * latency).max(q.seconds / 2.0);
            2.0 * (p - 1.0) / p * q.size / wire.max(1e-12)
        })
        .unwrap_or(bandwidth);
    let bandwidth = bandwidth.max(bus);
    pipec_plan::device::MeasuredLink { bandwidth, latency, efficiency: (bus / bandwidth).clamp(1e-9, 1.0) }
}

#[cfg(test)]
mod link_tests {
    use super::*;

    #[test]
    fn the_link_fit_recovers_the_figures_that_made_the_points() {
        // 5 µs per message at 8 GB/s; four workers' all-reduces at a 2 GB/s bus bandwidth
        let (latency, bandwidth, bus, p) = (5e-6, 8e9, 2e9, 4.0);
        let sizes = [4e3, 6.4e4, 1e6, 8e6, 3.2e7];
        let p2p: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: latency + b / bandwidth }).collect();
        let ring = |b: f64| 2.0 * (p - 1.0) * latency + 2.0 * (p - 1.0) / p * b / bus;
        let all_reduce: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: ring(b) }).collect();
        let l = fit_link(&p2p, &all_reduce, 4);
        assert!((l.latency - latency).abs() < 1e-9, "{l:?}");
        assert!((l.bandwidth / bandwidth - 1.0).abs() < 1e-6, "{l:?}");
        assert!((l.efficiency - 0.25).abs() < 1e-6, "{l:?}");
        // messages that cost no more as they grow (moved, not copied): the largest one's
        // rate, and an all-reduce faster than that raises the bandwidth to its own
        let flat: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: 2e-6 }).collect();
        let l = fit_link(&flat, &all_reduce, 4);
        assert!((l.bandwidth / (3.2e7 / 2e-6) - 1.0).abs() < 1e-6 && l.efficiency < 1.0, "{l:?}");
        let slow: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: b / 1e8 }).collect();
        // (the messages' line has no latency: the largest all-reduce's 6 latencies count
        // as its wire time, 0.1% of it)
        let l = fit_link(&slow, &all_reduce, 4);
        assert!((l.bandwidth / bus - 1.0).abs() < 2e-3 && l.efficiency == 1.0, "{l:?}");
    }
}
