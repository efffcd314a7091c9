//! Fuzz target: any bytes as a plan.json, through what `pipec run plan.json` does before it
//! trains: load (serde), the structural check every plan gets, and the stream verifier.
//! Must never panic: a hand-edited or hostile plan gets a message.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(plan) = pipec_plan::Plan::from_json(text) else { return };
    if plan.check().is_empty() {
        let _ = pipec_compiler::verification::verify_plan(&plan);
    }
});
