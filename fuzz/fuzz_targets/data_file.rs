//! Fuzz target: any bytes as a CSV or NPY training-data file, or a language model's token
//! file (text, raw uint16/uint32, npy), read by the one reader the executor and `pipec
//! check` share, for a model shape taken from the first bytes. Must never panic; what it
//! accepts must be finite with whole labels in range, token ids inside the vocabulary.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_plan::datafile::{parse_csv, parse_npy, parse_tokens, token_windows, Expect, TokenFile};
use pipec_plan::TokenDtype;

fuzz_target!(|data: &[u8]| {
    let Some((&head, body)) = data.split_first() else { return };
    let numel = usize::from(head & 0x0f) + 1;
    let classes = (head & 0x10 != 0).then_some(usize::from(head >> 5) + 2);
    let vocab = (head & 0x80 != 0 && classes.is_some()).then_some(16);
    let expect = Expect { numel, classes, outputs: classes.unwrap_or(1), vocab, positions: 1 };
    for complete in [true, false] {
        if let Ok(s) = parse_csv(body, complete, "fuzz.csv", &expect) {
            assert_eq!(s.inputs.len(), s.samples * numel);
            assert!(s.inputs.iter().chain(&s.targets).all(|v| v.is_finite()));
            if let Some(c) = classes {
                assert!(s.targets.iter().all(|&t| t.fract() == 0.0 && t >= 0.0 && t < c as f64));
            }
        }
        if let Ok(a) = parse_npy(body, complete, "fuzz.npy") {
            if complete {
                assert_eq!(a.values.len(), a.shape.iter().product::<usize>());
            }
        }
        let kinds =
            [TokenFile::Text, TokenFile::Raw(TokenDtype::Uint16), TokenFile::Raw(TokenDtype::Uint32), TokenFile::Npy];
        for kind in kinds {
            let vocab = usize::from(head) + 1;
            if let Ok(tokens) = parse_tokens(body, complete, kind, vocab, "fuzz.tokens") {
                assert!(tokens.iter().all(|&t| (t as usize) < vocab));
                if let Ok(w) = token_windows(&tokens, numel, "fuzz.tokens") {
                    assert_eq!((w.inputs.len(), w.targets.len()), (w.samples * numel, w.samples * numel));
                }
            }
        }
    }
});
