//! Runs a command under the sandbox filters, to try software against the policy:
//!
//! ```text
//! cargo run -p agentenv-seccomp --example filtered -- python3 -c 'import os; print(os.getpid())'
//! ```
//!
//! A call the policy refuses shows up as `EPERM` ("Operation not permitted"), an unlisted
//! one as `ENOSYS` ("Function not implemented"); `strace -f` outside the filter shows which.

use std::os::unix::process::CommandExt;

fn main() {
    let mut args = std::env::args_os().skip(1);
    let Some(program) = args.next() else {
        eprintln!("usage: filtered PROGRAM [ARGS...]");
        std::process::exit(2);
    };
    let filters = match agentenv_seccomp::sandbox_filters() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("filtered: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = agentenv_seccomp::install(&filters) {
        eprintln!("filtered: {e}");
        std::process::exit(1);
    }
    let err = std::process::Command::new(&program).args(args).exec();
    eprintln!("filtered: running {}: {err}", program.to_string_lossy());
    std::process::exit(127);
}
