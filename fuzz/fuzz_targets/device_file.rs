//! Fuzz target: any bytes as a device file (`pipec calibrate`'s JSON) → the reader a spec's
//! `device: { file }` uses. Must never panic; a device it accepts prices work as finite,
//! non-negative seconds.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_plan::device::DeviceModel;
use pipec_plan::Precision;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(d) = DeviceModel::from_json(text) {
        for p in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
            let t = d.matrix_time(1e12, 1e9, p);
            assert!(t.is_finite() && t >= 0.0, "{t}");
        }
        let v = d.vector_time(1e9, 1e9);
        assert!(v.is_finite() && v >= 0.0, "{v}");
    }
});
