use super::*;
use pipec_plan::device::{AttentionFit, ProductFit, Traffic};

#[test]
fn the_products_fit_finds_the_traffic_the_points_were_made_with() {
    // points from 2e11 FLOP/s reaching half of it at 1e6 FLOPs, operands beyond 1 MiB at
    // 1e10 B/s, a launch of 0.3 µs: the sweep's shapes; the traffic overlapping the compute
    // (the 2-norm) or added to it
    let (rate, half, launch) = (2e11, 1e6, 3e-7);
    for norm in [Traffic::OVERLAPPING, 1.0] {
        let traffic = Traffic { norm, ..Traffic::new(1e10, 1048576.0) };
        let mut d = DeviceModel::uniform("truth", 1e9, rate);
        (d.matrix_efficiency, d.product_traffic, d.launch) = (Curve { peak: 1.0, half }, Some(traffic), launch);
        let points: Vec<(f64, f64, f64)> = Sweep::CPU
            .products
            .iter()
            .map(|&s| {
                let (f, b) = (2.0 * (s.0 * s.1 * s.2) as f64, product_bytes(s));
                (f, b, d.matrix_time(f, b, pipec_plan::Precision::Fp32))
            })
            .collect();
        let (ProductFit { rate: r, half: h, traffic: t }, e) =
            fit_products_with_traffic(&points, launch).expect("fits");
        assert!((r / rate - 1.0).abs() < 1e-3 && h == half && t == traffic && e < 1e-6, "{r} {h} {t:?} {e}");
    }
    // points a product's compute alone explains: the roofline the first fit made fits
    // them exactly, and the refit keeps a model as close
    let compute = |s: (usize, usize, usize)| launch + (2.0 * (s.0 * s.1 * s.2) as f64 + half) / rate;
    let mut c = fitted(
        "compute",
        1e9,
        launch,
        Sweep::CPU
            .products
            .iter()
            .map(|&s| (s, Point { size: 2.0 * (s.0 * s.1 * s.2) as f64, seconds: compute(s) }))
            .collect(),
        vec![(1 << 10, Point { size: 12288.0, seconds: 1e-6 }), (1 << 20, Point { size: 1.2e7, seconds: 1e-4 })],
        vec![],
    );
    fit_product_traffic(&mut c);
    for &(s, p) in &c.products {
        let t = c.device.matrix_time(p.size, product_bytes(s), pipec_plan::Precision::Fp32);
        assert!((t / p.seconds - 1.0).abs() < 1e-3, "{s:?}: {t} against {}", p.seconds);
    }
}

#[test]
fn the_attention_fit_recovers_its_terms_and_never_goes_negative() {
    let truth = AttentionFit { per_call: 2e-5, per_mac: 3e-11, per_score: 4e-9, per_value: 5e-9 };
    let at = |f: &AttentionFit, (b, s, h, dh): AttentionShape| f.seconds((b * h) as f64, s as f64, dh as f64);
    let points: Vec<(AttentionShape, f64)> = ATTENTION_SHAPES.iter().map(|&s| (s, at(&truth, s))).collect();
    let fit = fit_attention(&points).expect("fits");
    for (got, want) in [
        (fit.per_call, truth.per_call),
        (fit.per_mac, truth.per_mac),
        (fit.per_score, truth.per_score),
        (fit.per_value, truth.per_value),
    ] {
        assert!((got / want - 1.0).abs() < 1e-6, "{fit:?}");
    }
    // times that fall with the scores (a negative coefficient would fit them best): that
    // term is dropped, and the rest are fitted without it
    let falling: Vec<(AttentionShape, f64)> =
        points.iter().map(|&((b, s, h, dh), t)| ((b, s, h, dh), t - 4.5e-9 * (b * h * s * s) as f64)).collect();
    assert!(falling.iter().all(|p| p.1 > 0.0), "{falling:?}");
    let fit = fit_attention(&falling).expect("fits");
    assert!([fit.per_call, fit.per_mac, fit.per_value].iter().all(|c| *c > 0.0) && fit.per_score == 0.0, "{fit:?}");
    assert!(fit_attention(&[]).is_none());
}

#[test]
fn the_executors_attention_is_timed_forward_and_backward() {
    let points =
        attention_passes::<crate::backend::CpuBackend>(&Default::default(), 3, &[(1, 8, 2, 4), (2, 16, 2, 8)], &|| {})
            .expect("runs");
    assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), vec![(1, 8, 2, 4), (2, 16, 2, 8)]);
    assert!(points.iter().all(|&(_, f, b)| f > 0.0 && b > 0.0 && f.is_finite() && b.is_finite()), "{points:?}");
}

#[test]
fn a_functions_gradient_is_timed_beyond_its_forward() {
    let g = function_gradients::<crate::backend::CpuBackend>(&Default::default(), 4096, 3);
    let names: Vec<&str> = g.iter().map(|(n, _)| *n).collect();
    let want = ["gelu_grad", "gelu_tanh_grad", "silu_grad", "tanh_grad", "silu_gated_grad", "gelu_gated_grad"];
    assert_eq!(names, [&want[..], &["cross_entropy_grad"]].concat());
    // a gated unit's by its output's elements, half its input's; the loss's by its logits
    let sizes: Vec<f64> = g.iter().map(|(_, p)| p.size).collect();
    assert_eq!(sizes, [4096.0, 4096.0, 4096.0, 4096.0, 2048.0, 2048.0, 4096.0]);
    let shape = |n: usize| {
        let (rows, classes, labels) = loss_case(n);
        assert!(labels.len() == rows && labels.iter().all(|&c| (0..classes as i64).contains(&c)), "{labels:?}");
        (rows, classes)
    };
    assert_eq!(shape(4096), (4, 1024));
    assert_eq!(shape(100), (1, 100));
    assert!(g.iter().all(|(_, p)| p.seconds > 0.0 && p.seconds.is_finite()), "{g:?}");
    let f = function_rates(&g, 0.0);
    assert!(f.gelu_grad > 0.0 && f.tanh_grad > 0.0 && f.silu_gated_grad > 0.0 && f.gelu == 0.0, "{f:?}");
}

#[test]
fn a_layers_products_are_timed_through_autodiff_one_product_a_point() {
    let points =
        layer_products::<crate::backend::CpuBackend>(&Default::default(), 3, &[(8, 16, 32), (16, 64, 64)], &|| {})
            .expect("linear layers run");
    assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), vec![(8, 16, 32), (16, 64, 64)]);
    for ((m, k, n), p, [backward, weights]) in points {
        assert_eq!(p.size, 2.0 * (m * k * n) as f64);
        assert!(p.seconds > 0.0 && p.seconds.is_finite(), "{p:?}");
        // the backward timed split: its weight half a part of it
        assert!(backward > 0.0 && backward.is_finite(), "{backward}");
        assert!(weights > 0.0 && weights < backward, "{weights} of {backward}");
    }
}

#[test]
fn the_input_and_weight_gradients_are_fitted_as_products_of_their_own_from_the_split_backward() {
    // weight gradients of 1e11 FLOP/s reaching half of it at 1e6 FLOPs, operands beyond 1
    // MiB at 1e10 B/s, input gradients of 2e11 FLOP/s with the same curve and traffic, a
    // launch of 0.3 µs, on the sweep's shapes (the forwards' times play no part)
    let truth = ProductFit { rate: 1e11, half: 1e6, traffic: Traffic::new(1e10, 1048576.0) };
    let input_truth = ProductFit { rate: 2e11, ..truth };
    let launch = 3e-7;
    let shapes = Sweep::CPU.products;
    let forwards: Vec<(Shape, Point)> =
        shapes.iter().map(|&s| (s, Point { size: 2.0 * (s.0 * s.1 * s.2) as f64, seconds: 1e-4 })).collect();
    let backwards: Vec<[f64; 2]> = forwards
        .iter()
        .map(|&(s, f)| {
            let half = |fit: ProductFit| launch + fit.seconds(f.size, product_bytes(s), 1.0);
            [half(input_truth) + half(truth), half(truth)]
        })
        .collect();
    let (input, fit) = gradient_fits(&forwards, &backwards, launch);
    let (input, fit) = (input.expect("the input gradients fit"), fit.expect("the weight gradients fit"));
    for (fit, truth) in [(fit, truth), (input, input_truth)] {
        assert!(
            (fit.rate / truth.rate - 1.0).abs() < 1e-3 && fit.half == truth.half && fit.traffic == truth.traffic,
            "{fit:?} against {truth:?}"
        );
    }
    // a device with a fit prices that gradient by it, one without as a product
    let mut device = DeviceModel::uniform("cpu", 1e9, 2e11);
    device.launch = launch;
    let (flops, bytes, fp32) = (2.0 * 64.0 * 512.0 * 512.0, product_bytes((64, 512, 512)), pipec_plan::Precision::Fp32);
    type Time = fn(&DeviceModel, f64, f64, pipec_plan::Precision) -> f64;
    type Set = fn(&mut DeviceModel, ProductFit);
    let halves: [(Time, Set, ProductFit, ProductFit); 2] = [
        (DeviceModel::weight_gradient_time, |d, f| d.weight_gradient = Some(f), fit, truth),
        (DeviceModel::input_gradient_time, |d, f| d.input_gradient = Some(f), input, input_truth),
    ];
    for (time, set, fitted, truth) in halves {
        assert_eq!(time(&device, flops, bytes, fp32), device.matrix_time(flops, bytes, fp32));
        set(&mut device, fitted);
        let t = time(&device, flops, bytes, fp32);
        assert!((t / (launch + truth.seconds(flops, bytes, 1.0)) - 1.0).abs() < 1e-3, "{t}");
    }
    // halves under ten launches say nothing: fewer than two points, no fit
    let short: Vec<[f64; 2]> = forwards.iter().map(|_| [4.0 * launch, 2.0 * launch]).collect();
    assert_eq!(gradient_fits(&forwards, &short, launch), (None, None));
}

#[test]
fn a_meeting_lets_copies_through_together_and_a_failed_copy_stops_the_others() {
    // three copies meet twice
    let meeting = Meeting::new(3);
    let passed: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3).map(|_| s.spawn(|| meeting.wait() && meeting.wait())).collect();
        handles.into_iter().map(|h| h.join().expect("joins")).collect()
    });
    assert_eq!(passed, vec![true; 3]);
    // one of three fails before the meeting: the two waiting are let go, refused
    let meeting = Meeting::new(3);
    let waited: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2).map(|_| s.spawn(|| meeting.wait())).collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        meeting.break_off();
        handles.into_iter().map(|h| h.join().expect("joins")).collect()
    });
    assert_eq!(waited, vec![false, false]);
    assert!(!meeting.wait(), "a broken meeting stays broken");
}

#[test]
fn an_updates_rates_are_solved_from_two_timings() {
    // 50 µs per tensor and 2 ns per parameter: 8 tensors of 4.2 M, 128 of 17,408
    let t = |tensors: usize, params: f64| {
        (tensors, Point { size: params, seconds: tensors as f64 * 50e-6 + params * 2e-9 })
    };
    let r = update_rate(t(8, 4.2e6), t(128, 17_408.0));
    assert!((r.per_tensor - 50e-6).abs() < 1e-12 && (r.per_parameter - 2e-9).abs() < 1e-18, "{r:?}");
    // noise that makes one part negative: the other explains both timings on average
    let r = update_rate((8, Point { size: 4.2e6, seconds: 1e-3 }), (128, Point { size: 17_408.0, seconds: 1e-6 }));
    assert!(r.per_tensor == 0.0 && r.per_parameter > 0.0, "{r:?}");
}

#[test]
fn the_plans_parameter_tensors_are_the_executors() {
    use pipec_plan::model::Op;
    let ops = [
        Op::Linear { in_features: 4, out_features: 3, bias: true },
        Op::Linear { in_features: 3, out_features: 4, bias: false },
        Op::LayerNorm { dim: 4, eps: 1e-5 },
        Op::RmsNorm { dim: 4, eps: 1e-5 },
        Op::Lstm { input: 4, hidden: 4 },
        Op::block(16, 2, 32, true),
        Op::llama_block(16, 4, 2, 24),
    ];
    for op in &ops {
        let model = crate::nn::layers::StageModel::<crate::backend::CpuBackend>::new(
            std::slice::from_ref(op),
            0,
            1,
            &Default::default(),
        );
        let layout = crate::nn::params::layout::<crate::backend::CpuBackend, _>(&model);
        assert_eq!(op.parameter_tensors(), layout.len(), "{op:?}");
    }
}

#[test]
fn a_line_through_exact_points_is_found_and_gives_the_device_back() {
    // a device of 1e11 FLOP/s with half = 2e6 FLOPs, 10 GB/s with half = 1e5 bytes,
    // launching in 5 µs: its own times give it back
    let launch = 5e-6;
    let products: Vec<Point> =
        [1e5, 1e6, 1e7, 1e8].iter().map(|&f| Point { size: f, seconds: launch + (f + 2e6) / 1e11 }).collect();
    let adds: Vec<(usize, Point)> = [1000usize, 100_000, 1_000_000]
        .iter()
        .map(|&n| (n, Point { size: 12.0 * n as f64, seconds: launch + (12.0 * n as f64 + 1e5) / 1e10 }))
        .collect();
    let d = fit("test", 1e9, launch, &products, &adds);
    assert!((d.matrix.fp32 / 1e11 - 1.0).abs() < 1e-9, "{}", d.matrix.fp32);
    assert!((d.matrix_efficiency.half / 2e6 - 1.0).abs() < 1e-6, "{}", d.matrix_efficiency.half);
    assert!((d.memory_bandwidth / 1e10 - 1.0).abs() < 1e-9, "{}", d.memory_bandwidth);
    assert!((d.memory_efficiency.half / 1e5 - 1.0).abs() < 1e-6, "{}", d.memory_efficiency.half);
    // the fitted model prices the points as measured
    for p in &products {
        let t = d.matrix_time(p.size, 0.0, pipec_plan::Precision::Fp32);
        assert!((t / p.seconds - 1.0).abs() < 1e-6, "{t} vs {}", p.seconds);
    }
    assert!(DeviceModel::from_json(&serde_json::to_string(&d).expect("json")).is_ok());
    assert_eq!(fit_line(&products[..1]), None);
}

#[test]
fn the_cpu_calibration_gives_a_device_file_the_front_end_reads() {
    let c = calibrate_cpu(4e9, 3).expect("calibrates");
    let d = &c.device;
    assert!(d.matrix.fp32 > 0.0 && d.memory_bandwidth > 0.0 && d.vector > 0.0 && d.launch > 0.0, "{d:?}");
    assert_eq!(c.products.len(), Sweep::CPU.products.len());
    assert_eq!(c.adds.len(), Sweep::CPU.adds.len());
    // every element-wise function the cost model prices by its own rate was measured
    let f = d.functions;
    assert_eq!(c.functions.len(), 15);
    let rates = f.rates();
    assert!(rates.iter().all(|r| r.is_finite() && *r > 0.0), "{f:?}");
    // the products were fitted with their traffic beyond the cache, or the roofline
    // where that was closer: either way every figure is one a device file takes
    if let Some(t) = d.product_traffic {
        assert!(t.bandwidth > 0.0 && t.cached >= 0.0, "{t:?}");
    }
    // the executor's attention was timed over the sweep and fitted
    assert_eq!(c.attention.len(), ATTENTION_SHAPES.len());
    assert!(d.attention.is_some(), "{d:?}");
    let mut bad = d.clone();
    if let Some(a) = bad.attention.as_mut() {
        a.backward.per_score = -1.0;
    }
    assert!(DeviceModel::from_json(&serde_json::to_string(&bad).expect("json")).is_err());
    let back = DeviceModel::from_json(&serde_json::to_string(d).expect("json")).expect("a valid device file");
    assert!((back.functions.gelu / f.gelu - 1.0).abs() < 1e-12, "{:?}", back.functions);
    // a negative rate in a device file is refused
    let mut bad = d.clone();
    bad.functions.exp = -1.0;
    assert!(DeviceModel::from_json(&serde_json::to_string(&bad).expect("json")).is_err());
}

#[test]
fn copies_measured_at_once_average_point_by_point_before_the_fit() {
    // two copies of a device, one twice as slow on every point: the mean device's
    // points are 1.5× the fast one's, and so is its fit (rates 1/1.5, launch 1.5×)
    let device = |k: f64| {
        let launch = k * 2e-6;
        let products = [1e6, 1e7, 1e8]
            .iter()
            .map(|&f| ((1, 1, 1), Point { size: f, seconds: k * (2e-6 + f / 1e11) }))
            .collect::<Vec<_>>();
        let adds = [1e4, 1e6].iter().map(|&b| (1usize, Point { size: b, seconds: k * (2e-6 + b / 1e10) })).collect();
        let functions = vec![("exp", Point { size: 65536.0, seconds: k * (2e-6 + 65536.0 / 1e9) })];
        fitted("x", 1e9, launch, products, adds, functions)
    };
    let (fast, slow) = (device(1.0), device(2.0));
    let mean = mean_calibration(&[fast.clone(), slow], 1e9, "two at once");
    assert_eq!(mean.device.name, "two at once");
    for (m, f) in mean.products.iter().zip(&fast.products) {
        assert!((m.1.seconds / f.1.seconds - 1.5).abs() < 1e-12, "{m:?} {f:?}");
    }
    assert!((fast.device.matrix.fp32 / mean.device.matrix.fp32 - 1.5).abs() < 1e-9);
    assert!((fast.device.memory_bandwidth / mean.device.memory_bandwidth - 1.5).abs() < 1e-9);
    assert!((mean.device.launch / fast.device.launch - 1.5).abs() < 1e-12);
    assert!((fast.device.functions.exp / mean.device.functions.exp - 1.5).abs() < 1e-9);
}

#[test]
fn a_functions_rate_is_its_elements_over_its_time_beyond_the_launch() {
    let launch = 1e-6;
    let measured = [("exp", Point { size: 65536.0, seconds: launch + 65536.0 / 2.5e8 })];
    let f = function_rates(&measured, launch);
    assert!((f.exp / 2.5e8 - 1.0).abs() < 1e-9, "{}", f.exp);
    // what was not measured stays 0: priced by its FLOPs
    assert_eq!((f.gelu, f.gelu_tanh, f.silu, f.tanh), (0.0, 0.0, 0.0, 0.0));
}

/// Adds made with a bandwidth that falls beyond a cache: the split recovers the cache and
/// the bandwidth beyond it, and prices the largest add within 1% where the one line was
/// off by half; adds that one line explains are left to it.
#[test]
fn the_adds_fit_finds_their_bytes_beyond_the_cache() {
    let launch = 5e-7;
    let truth = |bytes: f64| launch + bytes.min(786_432.0) / 6e10 + (bytes - 786_432.0).max(0.0) / 2e10;
    let adds: Vec<(usize, Point)> = Sweep::CPU
        .adds
        .iter()
        .map(|&n| (n, Point { size: 12.0 * n as f64, seconds: truth(12.0 * n as f64) }))
        .collect();
    let mut c = fitted("adds", 1e9, launch, vec![], adds.clone(), vec![]);
    let largest = adds.last().expect("adds").1;
    let off = |c: &Calibration| c.device.vector_time(0.0, largest.size) / largest.seconds - 1.0;
    assert!(off(&c).abs() > 0.3, "the one line: {}", off(&c));
    fit_memory_traffic(&mut c);
    let t = c.device.memory_traffic.expect("split");
    assert!(t.cached == 786_432.0 && (t.bandwidth / 2e10 - 1.0).abs() < 0.02, "{t:?}");
    assert!(off(&c).abs() < 0.01, "{}", off(&c));
    // a line through every add: no split
    let line: Vec<(usize, Point)> =
        adds.iter().map(|&(n, p)| (n, Point { size: p.size, seconds: launch + p.size / 5e10 })).collect();
    let mut c = fitted("line", 1e9, launch, vec![], line, vec![]);
    fit_memory_traffic(&mut c);
    assert_eq!(c.device.memory_traffic, None);
}
