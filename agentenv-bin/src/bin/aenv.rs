//! `aenv`: the AgentENV command line.

use clap::{CommandFactory, Parser};

fn main() {
    // `COMPLETE=<shell> aenv -- <words>`: answer a completion request and exit.
    clap_complete::CompleteEnv::with_factory(agentenv_bin::cli::Cli::command)
        .var(agentenv_bin::cli::complete::VAR)
        .complete();
    let cli = agentenv_bin::cli::Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("Error: starting the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = match rt.block_on(agentenv_bin::cli::run(cli)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("Error: {e}");
            1
        }
    };
    // Exit without waiting for the thread blocked reading the terminal (if any).
    std::process::exit(code);
}
