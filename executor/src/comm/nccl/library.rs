//! The NCCL library, loaded when a run asks for it: found by the names and in the places
//! NCCL is installed (a path in `PIPEC_NCCL_LIBRARY`; `libnccl.so.2` or `libnccl.so` through
//! the loader's search path; `$NCCL_HOME/lib`, CUDA's and conda's library folders, and the
//! `nvidia/nccl/lib` folder of the `nvidia-nccl-cu12` wheel that PyTorch installs), its
//! version checked, and its calls made through [`super::bootstrap::Nccl`] and on device
//! buffers ([`NcclLibrary::all_reduce`]).
//!
//! This module uses `unsafe` for the foreign calls alone: loading the library, resolving
//! its functions by their C signatures in `nccl.h`, and calling them (each call says what
//! it reads and writes).
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::bootstrap::{Nccl, Progress, UniqueId, UNIQUE_ID_BYTES};

/// `ncclResult_t`'s success and `ncclInProgress`.
const SUCCESS: c_int = 0;
const IN_PROGRESS: c_int = 7;
/// The oldest NCCL whose configuration this build passes (`ncclConfig_t` of NCCL 2.18).
const OLDEST: c_int = 21800;
/// `NCCL_CONFIG_INITIALIZER`'s magic number and `NCCL_CONFIG_UNDEF_INT`.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
const UNDEF: c_int = c_int::MIN;

/// How long a collective's non-blocking enqueueing may take.
const ENQUEUE_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The environment variable that names the library's file.
pub const LIBRARY_VAR: &str = "PIPEC_NCCL_LIBRARY";

#[repr(C)]
#[derive(Clone, Copy)]
struct RawId {
    internal: [u8; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.18 lays it out: later versions read its `size` and `version`
/// and take their defaults for the fields it lacks. The 4 bytes after `split_share` are
/// written too (`traffic_class`, undefined): NCCL 2.26 reads its `trafficClass` there,
/// whatever the version says, and padding would hand it garbage.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
}

type RawComm = *mut c_void;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut RawId) -> c_int;
type CommInitRankConfig = unsafe extern "C" fn(*mut RawComm, c_int, RawId, c_int, *mut Config) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
type CommEnd = unsafe extern "C" fn(RawComm) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type GetLastError = unsafe extern "C" fn(RawComm) -> *const c_char;
type AllReduce = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> c_int;

/// The library's calls pipec makes, resolved once.
pub struct NcclLibrary {
    path: PathBuf,
    version: c_int,
    get_unique_id: GetUniqueId,
    init: CommInitRankConfig,
    async_error: CommGetAsyncError,
    abort: CommEnd,
    destroy: CommEnd,
    error_string: GetErrorString,
    last_error: GetLastError,
    all_reduce: AllReduce,
    // the library stays loaded while any of its functions may be called
    _library: libloading::Library,
}

/// One rank's part of a communicator; destroyed when dropped (aborted where its start failed).
pub struct Communicator {
    raw: RawComm,
    library: Arc<NcclLibrary>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; a
// `Communicator` is owned by one rank's thread at a time. (NCCL 2.18 joins a non-blocking
// start's thread only when aborted from the thread that started it: the bootstrap does both
// on one thread.)
unsafe impl Send for Communicator {}

impl Communicator {
    /// Ends the communicator at once, without waiting for its work or its peers
    /// (`ncclCommAbort`): what a rank does when a peer has failed or gone silent.
    pub fn abort(mut self) {
        self.end(true);
    }

    fn end(&mut self, abort: bool) {
        if self.raw.is_null() {
            return;
        }
        // a communicator with an error or work in flight is aborted: `ncclCommDestroy` would
        // return at its error leaving it allocated, or wait on a dead peer for ever
        let healthy = !abort && self.library.state(self.raw) == Progress::Ready;
        let end = if healthy { self.library.destroy } else { self.library.abort };
        // SAFETY: `raw` came from ncclCommInitRankConfig and is ended once (then nulled).
        let r = unsafe { end(self.raw) };
        self.raw = std::ptr::null_mut();
        if r != SUCCESS && r != IN_PROGRESS {
            eprintln!("warning: NCCL could not end a communicator: {}", self.library.error(r, std::ptr::null_mut()));
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.end(false);
    }
}

/// The data types and reductions of NCCL's collectives (`ncclDataType_t`, `ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    F16,
    F32,
    Bf16,
}

impl DataType {
    fn code(self) -> c_int {
        match self {
            DataType::F16 => 6,
            DataType::F32 => 7,
            DataType::Bf16 => 9,
        }
    }
}

const SUM: c_int = 0;

/// The files to try, in order: `PIPEC_NCCL_LIBRARY` alone where it is set; otherwise the two
/// names through the loader's own search, then each folder NCCL is installed in
/// (`env`: the environment; `python_dirs`: a library folder's `python3.*` folders).
pub fn candidates(env: &dyn Fn(&str) -> Option<String>, python_dirs: &dyn Fn(&Path) -> Vec<PathBuf>) -> Vec<PathBuf> {
    if let Some(p) = env(LIBRARY_VAR).filter(|p| !p.trim().is_empty()) {
        return vec![PathBuf::from(p)];
    }
    const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];
    let mut folders: Vec<PathBuf> = Vec::new();
    let var = |v: &str| env(v).filter(|p| !p.trim().is_empty()).map(PathBuf::from);
    folders.extend(var("NCCL_HOME").map(|h| h.join("lib")));
    folders.extend(var("CUDA_HOME").map(|h| h.join("lib64")));
    folders.extend(var("CUDA_PATH").map(|h| h.join("lib64")));
    folders.push(PathBuf::from("/usr/local/cuda/lib64"));
    folders.extend(var("CONDA_PREFIX").map(|h| h.join("lib")));
    // PyTorch's wheel of NCCL, under a virtual environment, the user's, the system's or conda's
    let mut libs: Vec<PathBuf> = Vec::new();
    libs.extend(var("VIRTUAL_ENV").map(|h| h.join("lib")));
    libs.extend(var("CONDA_PREFIX").map(|h| h.join("lib")));
    libs.extend(var("HOME").map(|h| h.join(".local/lib")));
    libs.extend(["/usr/local/lib", "/usr/lib", "/opt/conda/lib"].map(PathBuf::from));
    for lib in libs {
        for py in python_dirs(&lib) {
            for packages in ["site-packages", "dist-packages"] {
                folders.push(py.join(packages).join("nvidia/nccl/lib"));
            }
        }
    }
    let mut out: Vec<PathBuf> = NAMES.iter().map(PathBuf::from).collect();
    for f in folders {
        out.extend(NAMES.iter().map(|n| f.join(n)));
    }
    out
}

/// Why NCCL would start blocking whatever pipec asks: `NCCL_COMM_BLOCKING` set to other
/// than 0 in the environment or in NCCL's configuration files (`~/.nccl.conf`,
/// `/etc/nccl.conf`), where a rank's failure would leave every other rank inside NCCL for
/// ever. None where it is not forced.
pub fn blocking_forced(env: &dyn Fn(&str) -> Option<String>, file: &dyn Fn(&Path) -> Option<String>) -> Option<String> {
    const VAR: &str = "NCCL_COMM_BLOCKING";
    let forced = |v: &str| !matches!(v.trim(), "" | "0");
    if let Some(v) = env(VAR).filter(|v| forced(v)) {
        return Some(format!(
            "{VAR}={v} makes NCCL's start blocking, so one rank's failure would hang the others: unset it"
        ));
    }
    // the environment wins over the files, as in NCCL
    if env(VAR).is_some() {
        return None;
    }
    let home = env("HOME").map(|h| PathBuf::from(h).join(".nccl.conf"));
    for path in home.into_iter().chain([PathBuf::from("/etc/nccl.conf")]) {
        let text = file(&path).unwrap_or_default();
        let set = text.lines().filter_map(|l| l.split_once('=')).find(|(k, _)| k.trim() == VAR);
        if let Some((_, v)) = set.filter(|(_, v)| forced(v)) {
            return Some(format!(
                "{} sets {VAR}={}, which makes NCCL's start blocking, so one rank's failure would hang the others: set {VAR}=0 in the environment",
                path.display(),
                v.trim()
            ));
        }
    }
    None
}

/// A library folder's `python3.*` folders, in name order.
pub fn python_dirs(lib: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(lib)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python3")))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// NCCL's version code as the words `2.21.5` (`X·10000 + Y·100 + Z` since 2.9,
/// `X·1000 + Y·100 + Z` before).
pub fn version_text(code: c_int) -> String {
    if code < 10000 {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    }
}

impl NcclLibrary {
    /// Loads the library from the first of [`candidates`] that loads, or says what was tried.
    pub fn open() -> Result<Arc<NcclLibrary>, String> {
        let tried = candidates(&|v| std::env::var(v).ok(), &python_dirs);
        let mut why = Vec::new();
        for path in &tried {
            // a folder's file that is not there is not worth a word; the loader's own search is
            if path.components().count() > 1 && !path.exists() {
                continue;
            }
            match Self::load(path) {
                Ok(l) => return Ok(Arc::new(l)),
                Err(e) => why.push(format!("{}: {e}", path.display())),
            }
        }
        let named = std::env::var(LIBRARY_VAR).ok().filter(|p| !p.trim().is_empty());
        Err(match named {
            Some(p) => format!("{LIBRARY_VAR}={p} does not load NCCL: {}", why.join("; ")),
            None => format!(
                "NCCL's library was not found: tried libnccl.so.2 and libnccl.so on the loader's path (LD_LIBRARY_PATH, ldconfig's cache), $NCCL_HOME/lib, CUDA's lib64, conda's lib and PyTorch's nvidia-nccl wheel{}; install NCCL (Debian's libnccl2, or `pip install nvidia-nccl-cu12`) or name its file with {LIBRARY_VAR}",
                if why.is_empty() { String::new() } else { format!(" ({})", why.join("; ")) }
            ),
        })
    }

    fn load(path: &Path) -> Result<NcclLibrary, String> {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        macro_rules! symbol {
            ($name:literal, $ty:ty) => {
                // SAFETY: the symbol is NCCL's function of that C signature (nccl.h).
                *unsafe { library.get::<$ty>($name) }.map_err(|e| {
                    format!("{} lacks {}: {e}", path.display(), String::from_utf8_lossy(&$name[..$name.len() - 1]))
                })?
            };
        }
        let get_version: GetVersion = symbol!(b"ncclGetVersion\0", GetVersion);
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { get_version(&mut version) };
        if r != SUCCESS {
            return Err(format!("ncclGetVersion failed ({r})"));
        }
        if version < OLDEST {
            return Err(format!(
                "it is NCCL {}, and pipec needs NCCL {} or newer (non-blocking communicators with ncclConfig_t of 2.18)",
                version_text(version),
                version_text(OLDEST)
            ));
        }
        Ok(NcclLibrary {
            path: path.to_path_buf(),
            version,
            get_unique_id: symbol!(b"ncclGetUniqueId\0", GetUniqueId),
            init: symbol!(b"ncclCommInitRankConfig\0", CommInitRankConfig),
            async_error: symbol!(b"ncclCommGetAsyncError\0", CommGetAsyncError),
            abort: symbol!(b"ncclCommAbort\0", CommEnd),
            destroy: symbol!(b"ncclCommDestroy\0", CommEnd),
            error_string: symbol!(b"ncclGetErrorString\0", GetErrorString),
            last_error: symbol!(b"ncclGetLastError\0", GetLastError),
            all_reduce: symbol!(b"ncclAllReduce\0", AllReduce),
            _library: library,
        })
    }

    /// Where it was loaded from, and its version, for the user.
    pub fn describe(&self) -> String {
        format!("NCCL {} ({})", version_text(self.version), self.path.display())
    }

    /// NCCL's words for a result, with the communicator's last error where it has one.
    fn error(&self, code: c_int, comm: RawComm) -> String {
        let words = |p: *const c_char| {
            // SAFETY: NCCL returns a static NUL-terminated string or null.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        // SAFETY: both take any value and return NUL-terminated strings NCCL owns (the last
        // warning is one process-wide buffer, read once here).
        let what = words(unsafe { (self.error_string)(code) }).unwrap_or_else(|| format!("NCCL error {code}"));
        let last = words(unsafe { (self.last_error)(comm) }).filter(|s| !s.is_empty());
        match last {
            Some(l) => format!("{what} (NCCL's last warning: {l})"),
            None => what,
        }
    }

    /// A sum over every rank of `count` values of `dtype` on the device, in place where
    /// `send` and `recv` are one buffer, queued on `stream` (a `CUstream`).
    ///
    /// # Safety
    /// `send` and `recv` are device buffers of `count` values of `dtype` on the
    /// communicator's GPU, and `stream` a stream of that GPU's context.
    pub unsafe fn all_reduce(
        &self,
        comm: &Communicator,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DataType,
        stream: *mut c_void,
    ) -> Result<(), String> {
        let r = (self.all_reduce)(send, recv, count, dtype.code(), SUM, comm.raw, stream);
        match r {
            SUCCESS | IN_PROGRESS => self.wait(comm),
            e => Err(format!("ncclAllReduce: {}", self.error(e, comm.raw))),
        }
    }

    /// The communicator's asynchronous error, if it has one (a peer gone, a network error),
    /// for a caller waiting on its work.
    pub fn failure(&self, comm: &Communicator) -> Option<String> {
        match self.state(comm.raw) {
            Progress::Failed(e) => Some(e),
            Progress::Ready | Progress::Pending => None,
        }
    }

    /// Waits until a non-blocking call's enqueueing is done (not its work on the stream), at
    /// most `ENQUEUE_LIMIT`: a first collective connects the peers, and a dead one never
    /// answers (the caller then aborts the communicator).
    fn wait(&self, comm: &Communicator) -> Result<(), String> {
        let begun = std::time::Instant::now();
        loop {
            match self.state(comm.raw) {
                Progress::Ready => return Ok(()),
                Progress::Pending if begun.elapsed() > ENQUEUE_LIMIT => {
                    return Err(format!(
                        "NCCL had not queued the collective after {} s (a peer gone?)",
                        ENQUEUE_LIMIT.as_secs()
                    ))
                }
                Progress::Pending => std::thread::sleep(std::time::Duration::from_micros(50)),
                Progress::Failed(e) => return Err(e),
            }
        }
    }
}

impl NcclLibrary {
    /// Where a communicator's last non-blocking call stands (`ncclCommGetAsyncError`).
    fn state(&self, raw: RawComm) -> Progress {
        let mut state: c_int = SUCCESS;
        // SAFETY: `raw` is a communicator this library made; writes one int.
        let r = unsafe { (self.async_error)(raw, &mut state) };
        match (r, state) {
            (SUCCESS, SUCCESS) => Progress::Ready,
            (SUCCESS, IN_PROGRESS) => Progress::Pending,
            (SUCCESS, e) | (e, _) => Progress::Failed(self.error(e, raw)),
        }
    }
}

impl Nccl for Arc<NcclLibrary> {
    type Comm = Communicator;
    fn unique_id(&self) -> Result<UniqueId, String> {
        let mut id = RawId { internal: [0; UNIQUE_ID_BYTES] };
        // SAFETY: writes the 128 bytes of one id.
        match unsafe { (self.get_unique_id)(&mut id) } {
            SUCCESS => Ok(id.internal),
            e => Err(self.error(e, std::ptr::null_mut())),
        }
    }
    fn start(&self, id: &UniqueId, ranks: usize, rank: usize) -> Result<Communicator, String> {
        if let Some(why) = blocking_forced(&|v| std::env::var(v).ok(), &|p| std::fs::read_to_string(p).ok()) {
            return Err(why);
        }
        let mut config = Config {
            size: std::mem::size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: OLDEST as u32,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
            traffic_class: UNDEF,
        };
        let mut raw: RawComm = std::ptr::null_mut();
        let n = c_int::try_from(ranks).map_err(|_| format!("{ranks} ranks are too many for NCCL"))?;
        // SAFETY: `raw` and `config` outlive the call; the id is passed by value as nccl.h does.
        let r = unsafe { (self.init)(&mut raw, n, RawId { internal: *id }, rank as c_int, &mut config) };
        let comm = Communicator { raw, library: self.clone() };
        match r {
            SUCCESS | IN_PROGRESS => Ok(comm),
            e => {
                let why = self.error(e, raw);
                self.abort(comm);
                Err(format!("ncclCommInitRankConfig: {why}"))
            }
        }
    }
    fn progress(&self, comm: &Communicator) -> Progress {
        self.state(comm.raw)
    }
    fn abort(&self, comm: Communicator) {
        comm.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_library_is_looked_for_by_its_usual_names_and_places() {
        let pythons = |lib: &Path| {
            if lib == Path::new("/venv/lib") {
                vec![lib.join("python3.12")]
            } else {
                vec![]
            }
        };
        let c = candidates(&env(&[("CUDA_HOME", "/opt/cuda"), ("VIRTUAL_ENV", "/venv")]), &pythons);
        let c: Vec<String> = c.iter().map(|p| p.display().to_string()).collect();
        // the bare names first (the loader's search: LD_LIBRARY_PATH, ldconfig's cache), the
        // soname before the development link
        assert_eq!(c[..2], ["libnccl.so.2", "libnccl.so"]);
        for want in [
            "/opt/cuda/lib64/libnccl.so.2",
            "/usr/local/cuda/lib64/libnccl.so.2",
            "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
        ] {
            assert!(c.iter().any(|p| p == want), "{want} in {c:?}");
        }
        // a path the user names is the only one tried
        let named = candidates(&env(&[(LIBRARY_VAR, "/x/libnccl.so.2.21.5"), ("CUDA_HOME", "/opt/cuda")]), &pythons);
        assert_eq!(named, vec![PathBuf::from("/x/libnccl.so.2.21.5")]);
    }

    #[test]
    fn a_missing_or_wrong_library_is_a_clear_error() {
        // on a machine without NCCL the error says what was tried and how to fix it
        if std::env::var(LIBRARY_VAR).is_err() {
            if let Err(e) = NcclLibrary::open() {
                assert!(e.contains("NCCL's library was not found: tried libnccl.so.2"), "{e}");
                assert!(e.contains(LIBRARY_VAR), "{e}");
            }
        }
        let e = NcclLibrary::load(Path::new("/nonexistent/libnccl.so.2")).err().expect("refused");
        assert!(e.contains("libnccl.so.2"), "{e}");
        // a library that loads but is not NCCL is refused by name of the missing function
        let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6", "/usr/lib/libc.so.6"]
            .into_iter()
            .find(|p| Path::new(p).exists());
        if let Some(libc) = libc {
            let e = NcclLibrary::load(Path::new(libc)).err().expect("refused");
            assert!(e.contains("lacks ncclGetVersion"), "{e}");
        }
    }

    #[test]
    fn versions_read_as_nccl_writes_them() {
        assert_eq!(version_text(21805), "2.18.5");
        assert_eq!(version_text(22703), "2.27.3");
        assert_eq!(version_text(2708), "2.7.8");
        assert_eq!(std::mem::size_of::<Config>(), 48);
        assert_eq!(std::mem::size_of::<RawId>(), 128);
    }

    #[test]
    fn a_forced_blocking_start_is_refused_from_the_environment_or_ncclconf() {
        let none = |_: &Path| None;
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(blocking_forced(&env(&[]), &none), None);
        assert_eq!(blocking_forced(&env(&[("NCCL_COMM_BLOCKING", "0")]), &none), None);
        let e = blocking_forced(&env(&[("NCCL_COMM_BLOCKING", "1")]), &none).expect("refused");
        assert!(e.contains("NCCL_COMM_BLOCKING=1 makes NCCL's start blocking"), "{e}");
        let conf = |p: &Path| {
            (p == Path::new("/etc/nccl.conf")).then(|| "NCCL_DEBUG=WARN\nNCCL_COMM_BLOCKING = 1\n".to_string())
        };
        let e = blocking_forced(&env(&[]), &conf).expect("refused");
        assert!(e.contains("/etc/nccl.conf sets NCCL_COMM_BLOCKING=1"), "{e}");
        // the environment's 0 wins over the file
        assert_eq!(blocking_forced(&env(&[("NCCL_COMM_BLOCKING", "0")]), &conf), None);
    }
}
