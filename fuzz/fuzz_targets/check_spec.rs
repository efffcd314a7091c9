//! Fuzz target: any bytes as a spec file through the whole front end (YAML, lowering, DSLs,
//! shape inference, strategy checks) and both renderers. Must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        let result = pipec_grammar::check_source(src);
        for d in &result.diagnostics {
            for l in &d.labels {
                assert!(l.span.start <= l.span.end && l.span.end <= src.len());
            }
        }
        let _ = pipec_grammar::diagnostic::render_human("fuzz.yaml", src, &result.diagnostics, false);
        let _ = pipec_grammar::diagnostic::render_json("fuzz.yaml", src, &result.diagnostics);
    }
});
