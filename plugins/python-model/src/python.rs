//! The embedded interpreter: started once per process from the PyTorch virtualenv the plugin was
//! built with, after checking that its `torch` is the libtorch trainerd links; the runtime
//! (`runtime.py`) loaded into it; tensors passed both ways; Python exceptions made into errors.

use std::ffi::{c_void, CStr, CString};
use std::sync::OnceLock;

use pyo3::prelude::*;
use pyo3::types::PyModule;
use trainerd_sdk::abi::{C_tensor, LIBTORCH_VERSION};
use trainerd_sdk::tch::Tensor;
use trainerd_sdk::PluginError;

unsafe extern "C" {
    fn tdp_wrap(t: *mut C_tensor) -> *mut pyo3::ffi::PyObject;
    fn tdp_unpack(o: *mut pyo3::ffi::PyObject) -> *mut C_tensor;
}

/// The virtualenv's base interpreter (its `sys.base_prefix`), as the build found it;
/// `TRAINERD_PYTHON_HOME` names another (the same Python version installed at another path).
const HOME: &str = env!("TRAINERD_PYTHON_HOME");
/// The virtualenv's site-packages, as the build found it; `TRAINERD_PYTHON_SITE` names another
/// (a virtualenv of the same Python and the same torch at another path).
const SITE: &str = env!("TRAINERD_PYTHON_SITE");
/// `3.11`.
const VERSION: &str = env!("TRAINERD_PYTHON_VERSION");
/// The virtualenv's python.
const PYTHON: &str = env!("TRAINERD_PYTHON_EXECUTABLE");

const RUNTIME: &str = include_str!("runtime.py");
/// The runtime's part for Keras models, which it imports as `trainerd_keras_runtime`.
const KERAS_RUNTIME: &str = include_str!("keras_model.py");

/// Before the interpreter starts: its checks, with the site-packages on the path, `torch` not yet
/// imported (a `torch` of another version would load a second libtorch).
const PREFLIGHT: &str = r#"
import importlib.metadata, importlib.util, os, site, sys
site.addsitedir(SITE)
# PYTHONPATH after the virtualenv's packages (the interpreter was started ignoring it).
sys.path.extend(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
sys.executable = PYTHON
spec = importlib.util.find_spec("torch")
if spec is None:
    raise ImportError(f"no torch in {SITE} (the virtualenv this plugin was built with; scripts/setup.sh makes it)")
found = importlib.metadata.version("torch")
if found.split("+")[0] != LIBTORCH.split("+")[0]:
    raise ImportError(f"the virtualenv's torch is {found} ({spec.origin}) but trainerd links libtorch {LIBTORCH}: "
                      f"install torch=={LIBTORCH.split('+')[0]} there, or rebuild trainerd against {found}")
"#;

/// The site-packages the interpreter takes its packages from.
fn site() -> String {
    std::env::var("TRAINERD_PYTHON_SITE").unwrap_or_else(|_| SITE.to_string())
}

/// The base interpreter's prefix the interpreter starts from.
fn home() -> String {
    std::env::var("TRAINERD_PYTHON_HOME").unwrap_or_else(|_| HOME.to_string())
}

/// The interpreter's executable (what multiprocessing and the like start): the virtualenv's, or
/// the base interpreter's of `TRAINERD_PYTHON_HOME`.
fn executable() -> String {
    match std::env::var("TRAINERD_PYTHON_HOME") {
        Ok(home) => format!("{home}/bin/python{VERSION}"),
        Err(_) => PYTHON.to_string(),
    }
}

static RUNTIME_MODULE: OnceLock<Result<Py<PyModule>, String>> = OnceLock::new();

/// Makes libpython's symbols global: the plugin was loaded with them local, and the extension
/// modules Python loads (`torch._C`, the standard library's own) look for them in the global scope.
fn promote_libpython() -> Result<(), String> {
    // SAFETY: Dl_info is plain pointers, for which all zeroes is a valid (null) value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr reads the address of a function of libpython's, which this library links.
    let found = unsafe { libc::dladdr(pyo3::ffi::Py_IsInitialized as *const c_void, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return Err("cannot locate libpython in this process".into());
    }
    // SAFETY: `dli_fname` is the path of a loaded library; RTLD_NOLOAD only changes its flags.
    let handle = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_GLOBAL | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        // SAFETY: a NUL-terminated path from dladdr.
        let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
        return Err(format!("cannot make {path}'s symbols global"));
    }
    Ok(())
}

/// Starts the interpreter: the virtualenv's base Python, found from its home whatever the
/// process's PATH and Python variables say (PYTHONHOME, a `python3` of another virtualenv first on
/// PATH), without the site-packages of any environment (the preflight adds the virtualenv's), and
/// without Python's signal handlers (the daemon handles SIGTERM and SIGINT). The GIL is released
/// for [`Python::with_gil`].
fn initialize() -> Result<(), String> {
    use pyo3::ffi;
    let text = |s: &str| CString::new(s).map_err(|_| format!("{s:?} holds a NUL"));
    let base = home();
    let (home, program) = (text(&base)?, text(&format!("{base}/bin/python{VERSION}"))?);
    // SAFETY: the documented PyConfig sequence (init, set, initialize, clear) on a config that
    // lives through it, once per process (under the OnceLock), before any other Python call.
    unsafe {
        let mut config = std::mem::MaybeUninit::<ffi::PyConfig>::uninit();
        ffi::PyConfig_InitPythonConfig(config.as_mut_ptr());
        let mut config = config.assume_init();
        config.install_signal_handlers = 0;
        config.site_import = 0;
        config.parse_argv = 0;
        config.use_environment = 0;
        let home_field: *mut *mut libc::wchar_t = &mut config.home;
        let program_field: *mut *mut libc::wchar_t = &mut config.program_name;
        let set = [
            ffi::PyConfig_SetBytesString(&mut config, home_field, home.as_ptr()),
            ffi::PyConfig_SetBytesString(&mut config, program_field, program.as_ptr()),
        ];
        let status = match set.into_iter().find(|s| ffi::PyStatus_Exception(*s) != 0) {
            Some(failed) => failed,
            None => ffi::Py_InitializeFromConfig(&config),
        };
        ffi::PyConfig_Clear(&mut config);
        if ffi::PyStatus_Exception(status) != 0 {
            let why = if status.err_msg.is_null() {
                "no reason given".into()
            } else {
                CStr::from_ptr(status.err_msg).to_string_lossy().into_owned()
            };
            return Err(format!("starting Python {VERSION} from {base}: {why}"));
        }
        ffi::PyEval_SaveThread();
    }
    Ok(())
}

/// Starts the interpreter and loads the runtime, once per process.
fn runtime() -> Result<&'static Py<PyModule>, PluginError> {
    let started = RUNTIME_MODULE.get_or_init(|| {
        promote_libpython()?;
        initialize()?;
        Python::with_gil(|py| {
            let globals = pyo3::types::PyDict::new(py);
            let prepared = (|| {
                globals.set_item("SITE", site())?;
                // Where the virtualenv's own interpreter is: what multiprocessing and the like start.
                globals.set_item("PYTHON", executable())?;
                globals.set_item("LIBTORCH", LIBTORCH_VERSION)?;
                let code = CString::new(PREFLIGHT).expect("no NUL");
                py.run(&code, Some(&globals), None)?;
                let code = CString::new(KERAS_RUNTIME).expect("no NUL");
                PyModule::from_code(py, &code, c"trainerd_keras_runtime.py", c"trainerd_keras_runtime")?;
                let code = CString::new(RUNTIME).expect("no NUL");
                let module = PyModule::from_code(py, &code, c"trainerd_python_runtime.py", c"trainerd_python_runtime")?;
                Ok::<_, PyErr>(module.unbind())
            })();
            prepared.map_err(|e| {
                format!("starting Python {VERSION} ({}, packages from {}): {}", home(), site(), message(py, &e))
            })
        })
    });
    started.as_ref().map_err(|e| PluginError::Other(e.clone()))
}

/// Runs `f` with the GIL and the runtime module; a Python exception becomes an error.
pub(crate) fn with_runtime<T>(
    f: impl for<'py> FnOnce(Python<'py>, &Bound<'py, PyModule>) -> PyResult<T>,
) -> Result<T, PluginError> {
    let runtime = runtime()?;
    Python::with_gil(|py| f(py, runtime.bind(py)).map_err(|e| error(py, e)))
}

/// A Python tensor that is `t` (no copy).
pub(crate) fn to_py<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: a live tensor handle; called with the GIL, after `import torch` (the runtime did).
    let object = unsafe { tdp_wrap(t.as_ptr() as *mut C_tensor) };
    // SAFETY: a new reference, or null with a Python error set.
    unsafe { Bound::from_owned_ptr_or_err(py, object) }
}

/// The tensor that the Python object `o` is (no copy); an error naming its type otherwise.
pub(crate) fn from_py(o: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    // SAFETY: a live object, with the GIL held.
    let tensor = unsafe { tdp_unpack(o.as_ptr()) };
    if tensor.is_null() {
        let kind = o.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        return Err(pyo3::exceptions::PyTypeError::new_err(format!("expected a torch.Tensor, got {kind}")));
    }
    // SAFETY: a new torch::Tensor that we now own.
    Ok(unsafe { Tensor::from_ptr(tensor) })
}

/// What a Python exception says: the runtime's own errors as they are (they name the file),
/// anything else as `Type: message`.
fn message(py: Python<'_>, e: &PyErr) -> String {
    let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_else(|_| "Exception".into());
    let text = e.value(py).str().map(|s| s.to_string()).unwrap_or_default();
    if kind == "ModelFileError" {
        text
    } else {
        format!("{kind}: {text}")
    }
}

/// A Python exception as a plugin error.
pub(crate) fn error(py: Python<'_>, e: PyErr) -> PluginError {
    PluginError::Other(message(py, &e))
}
