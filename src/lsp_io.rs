//! The language server's stdio transport. `lsp-server`'s own reader stops at the first
//! malformed frame, and the server then exits with status 0 as if the client had shut it
//! down. This one answers what it cannot read with a JSON-RPC error (`-32700` parse error,
//! `-32600` invalid request) and keeps serving: a bad `Content-Length`, a body that is not
//! UTF-8 or not JSON, a JSON value that is not a message.

use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{bounded, Receiver, Sender};
use lsp_server::{Connection, Message};

/// The largest message body read; a larger `Content-Length` is answered with an error.
const MAX_BODY: usize = 64 << 20;

/// JSON-RPC's "parse error" and "invalid request" codes.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;

/// The threads behind a [`Connection`]; joined when the server ends.
pub struct Io {
    reader: std::thread::JoinHandle<()>,
    writer: std::thread::JoinHandle<()>,
}

impl Io {
    pub fn join(self) {
        let _ = self.writer.join();
        // the reader may be blocked on stdin; it ends with the process
        drop(self.reader);
    }
}

fn write_frame(out: &Mutex<std::io::Stdout>, body: &str) -> std::io::Result<()> {
    write_bytes(out, format!("Content-Length: {}\r\n\r\n{body}", body.len()).as_bytes())
}

/// Writes one whole frame while holding the lock, so frames from the reader (errors) and
/// the writer (everything else) never interleave.
fn write_bytes(out: &Mutex<std::io::Stdout>, frame: &[u8]) -> std::io::Result<()> {
    let stdout = out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut w = stdout.lock();
    w.write_all(frame)?;
    w.flush()
}

fn error_frame(id: &serde_json::Value, code: i64, message: &str) -> String {
    serde_json::json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } }).to_string()
}

/// What one frame of input held.
enum Frame {
    Message(Message),
    /// Not a message: answer with this error (`id` null unless the body named one).
    Bad {
        id: serde_json::Value,
        code: i64,
        message: String,
    },
    End,
}

/// Reads one frame: headers up to an empty line, then `Content-Length` bytes.
fn read_frame(input: &mut impl BufRead) -> Frame {
    let mut length: Option<Result<usize, String>> = None;
    let mut line = String::new();
    loop {
        line.clear();
        let mut raw = Vec::new();
        match input.read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => return Frame::End,
            Ok(_) => {}
        }
        line.push_str(&String::from_utf8_lossy(&raw));
        let header = line.trim_end_matches(['\r', '\n']);
        if header.is_empty() {
            if length.is_some() {
                break;
            }
            continue; // blank lines between frames
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.trim().eq_ignore_ascii_case("content-length") {
                length = Some(
                    value
                        .trim()
                        .parse::<usize>()
                        .map_err(|_| format!("bad Content-Length `{}`", value.trim()))
                        .and_then(|n| {
                            if n <= MAX_BODY {
                                Ok(n)
                            } else {
                                Err(format!("Content-Length {n} is larger than {MAX_BODY} bytes"))
                            }
                        }),
                );
            }
        }
        // other headers (Content-Type) and stray lines are skipped
    }
    let n = match length {
        Some(Ok(n)) => n,
        Some(Err(message)) => return Frame::Bad { id: serde_json::Value::Null, code: PARSE_ERROR, message },
        None => return Frame::End,
    };
    let mut body = vec![0u8; n];
    if input.read_exact(&mut body).is_err() {
        return Frame::End;
    }
    let Ok(text) = String::from_utf8(body) else {
        return Frame::Bad { id: serde_json::Value::Null, code: PARSE_ERROR, message: "the body is not UTF-8".into() };
    };
    let value: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            return Frame::Bad { id: serde_json::Value::Null, code: PARSE_ERROR, message: format!("not JSON: {e}") }
        }
    };
    let id = value.get("id").cloned().unwrap_or(serde_json::Value::Null);
    match serde_json::from_value::<Message>(value) {
        Ok(m) => Frame::Message(m),
        Err(e) => Frame::Bad { id, code: INVALID_REQUEST, message: format!("not a JSON-RPC message: {e}") },
    }
}

/// A connection over stdin/stdout that survives malformed input.
pub fn stdio() -> (Connection, Io) {
    let stdout = Arc::new(Mutex::new(std::io::stdout()));
    let (to_client, outgoing): (Sender<Message>, Receiver<Message>) = bounded(0);
    let writer = {
        let stdout = stdout.clone();
        std::thread::spawn(move || {
            for msg in outgoing {
                // lsp-server's own framing (it adds `"jsonrpc": "2.0"`)
                let mut frame = Vec::new();
                if msg.write(&mut frame).is_err() || write_bytes(&stdout, &frame).is_err() {
                    return;
                }
            }
        })
    };
    let (incoming, from_client): (Sender<Message>, Receiver<Message>) = bounded(0);
    let reader = std::thread::spawn(move || {
        let stdin = std::io::stdin();
        let mut input = stdin.lock();
        loop {
            match read_frame(&mut input) {
                Frame::End => return,
                Frame::Bad { id, code, message } => {
                    if write_frame(&stdout, &error_frame(&id, code, &message)).is_err() {
                        return;
                    }
                }
                Frame::Message(m) => {
                    let exit = matches!(&m, Message::Notification(n) if n.method == "exit");
                    if incoming.send(m).is_err() || exit {
                        return;
                    }
                }
            }
        }
    });
    (Connection { sender: to_client, receiver: from_client }, Io { reader, writer })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[u8]) -> Vec<String> {
        let mut r = std::io::Cursor::new(input.to_vec());
        let mut out = Vec::new();
        loop {
            match read_frame(&mut r) {
                Frame::End => return out,
                Frame::Bad { code, message, .. } => out.push(format!("error {code}: {message}")),
                Frame::Message(m) => out.push(format!("message {}", serde_json::to_string(&m).unwrap_or_default())),
            }
        }
    }

    #[test]
    fn malformed_frames_become_errors_and_reading_goes_on() {
        let ok = r#"{"jsonrpc":"2.0","method":"initialized","params":{}}"#;
        let mut input = Vec::new();
        for body in [&b"{this is not json"[..], b"\xff\xfe", br#"{"jsonrpc":"2.0","id":3,"method":5}"#, ok.as_bytes()] {
            input.extend(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
            input.extend(body);
        }
        input.extend(b"Content-Length: abc\r\n\r\n");
        input.extend(format!("Content-Length: {}\r\n\r\n{ok}", ok.len()).as_bytes());
        let got = frames(&input);
        assert_eq!(got.len(), 6, "{got:?}");
        assert!(got[0].starts_with("error -32700: not JSON"), "{got:?}");
        assert!(got[1].starts_with("error -32700: the body is not UTF-8"), "{got:?}");
        assert!(got[2].starts_with("error -32600"), "{got:?}");
        assert!(got[3].starts_with("message") && got[5].starts_with("message"), "{got:?}");
        assert!(got[4].starts_with("error -32700: bad Content-Length `abc`"), "{got:?}");
    }
}
