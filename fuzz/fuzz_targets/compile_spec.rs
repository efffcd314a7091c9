//! Fuzz target: any spec the front end accepts goes through the whole compiler (IR, cost
//! model, partitioning, schedule, lowering, verification, simulation, memory check,
//! rendering; the strategy search for `auto` strategies). Must never panic; a verification
//! failure would be a compiler bug (E0603).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else { return };
    let Some(spec) = pipec_grammar::check_source(src).spec else { return };
    let options = pipec_compiler::CompileOptions { source: Some(src.into()), ..Default::default() };
    let result = pipec_compiler::compile(&spec, &options);
    assert!(result.diagnostics.iter().all(|d| d.code != "E0603"), "compiler bug: {:?}\n{src}", result.diagnostics);
    if let Some(c) = result.compiled {
        let _ = pipec_compiler::render::timeline_svg(&c.plan, &c.timeline);
        let _ = pipec_compiler::render::memory_svg(&c.plan);
        let _ = pipec_compiler::render::trace_json(&c.plan, &c.timeline);
        assert!(
            c.plan.simulation.step_time_s.is_finite() && c.plan.simulation.step_time_s >= 0.0,
            "step time {}",
            c.plan.simulation.step_time_s
        );
    }
});
