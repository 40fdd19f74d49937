//! `agentenv`: the all-in-one binary. `agentenv up` runs a whole cluster on this machine.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use agentenv_bin::up::{Up, UpOptions, stdout_out};
use clap::{Parser, Subcommand};
use tokio::signal::unix::{Signal, SignalKind, signal};

#[derive(Parser)]
#[command(
    name = "agentenv",
    version,
    about = "AgentENV all-in-one tool: a local cluster (up) and a cluster's certificates (certs)"
)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start a scheduler, a gateway and N runtime nodes on this machine (loopback), run a
    /// first sandbox through the gateway, print how to use the cluster, and stop
    /// everything (sandboxes included) on Ctrl-C.
    Up(UpArgs),
    /// Make a CA for a cluster and the certificates it signs (PEM files), for a
    /// deployment with TLS on every listener and link (docs/static-multi-node.md).
    #[command(subcommand)]
    Certs(CertsCmd),
}

#[derive(Subcommand)]
enum CertsCmd {
    /// Make a CA: <dir>/ca.pem (give it to every host and client) and
    /// <dir>/ca-key.pem (mode 0600; keep it where certificates are issued).
    /// An existing CA is never replaced.
    Ca {
        /// Where the CA's files go (made with mode 0700).
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
    },
    /// Issue a certificate signed by the CA in <dir>: <dir>/<name>.pem and
    /// <dir>/<name>-key.pem (mode 0600), valid for 127.0.0.1, ::1, localhost and
    /// the addresses and names given, usable to serve and as a client identity
    /// (mutual TLS).
    Issue {
        /// The CA's directory (from `agentenv certs ca`).
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// Names the files and the certificate, e.g. gateway, scheduler, node-a.
        #[arg(long)]
        name: String,
        /// An IP address the holder is reached at (repeat for more).
        #[arg(long = "ip", value_name = "IP")]
        ips: Vec<std::net::IpAddr>,
        /// A DNS name the holder is reached at (repeat for more).
        #[arg(long = "dns", value_name = "NAME")]
        dns: Vec<String>,
        /// A client-only certificate (it cannot serve).
        #[arg(long)]
        client: bool,
        /// Days of validity.
        #[arg(long, default_value_t = 825)]
        days: u32,
        /// Replace an existing certificate of that name (a renewal).
        #[arg(long)]
        force: bool,
    },
}

#[derive(clap::Args)]
struct UpArgs {
    /// Number of runtime nodes.
    #[arg(long, default_value_t = 2)]
    nodes: u8,
    /// The gateway's HTTP address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Directory of agentenv-scheduler, agentenv-gateway and agentenv-node
    /// (default: beside this binary).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// The static guest agent (default: AENV_GUEST_BINARY_PATH, else the static build in
    /// the target directory).
    #[arg(long, value_name = "PATH")]
    guest_binary: Option<PathBuf>,
    /// Keep node data and logs here (default: a temporary directory removed on exit).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Template cache shared by the nodes; `base` is built here once.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/cache/agentenv/templates"
    )]
    template_dir: PathBuf,
    /// The API key (default: AENV_API_KEY, else a fresh random key).
    #[arg(long, env = "AENV_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Do not run a first sandbox before announcing the cluster.
    #[arg(long)]
    no_check: bool,
    /// First two octets of the sandbox address pools (node i gets <prefix>.<i>.0/24).
    #[arg(long, default_value = "10.13")]
    pool_prefix: String,
    /// Prefix of the host interfaces of sandboxes (node i appends a letter); node i's
    /// cgroup parent is agentenv-<prefix><letter>. Clusters sharing a host need distinct
    /// prefixes.
    #[arg(long, default_value = "up")]
    iface_prefix: String,
    /// Show every log line of the child processes.
    #[arg(long, short)]
    verbose: bool,
    /// Run the whole cluster over TLS: a CA made for this cluster signs a
    /// certificate for the gateway, the scheduler and each node (written under
    /// <data dir>/tls/); the gateway and the nodes reach the scheduler, and the
    /// gateway the nodes, with mutual TLS. Clients trust <data dir>/tls/ca.pem
    /// (SSL_CERT_FILE for the E2B SDKs and aenv).
    #[arg(long)]
    tls: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("agentenv: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentenv: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let a = match args.command {
        Cmd::Up(a) => a,
        Cmd::Certs(c) => return certs(c),
    };
    let bin_dir = match a.bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    let mut opts = UpOptions::new(bin_dir);
    opts.nodes = a.nodes;
    opts.listen = a.listen;
    opts.guest_binary = a.guest_binary;
    opts.data_dir = a.data_dir;
    opts.template_dir = a.template_dir;
    opts.api_key = a.api_key.filter(|k| !k.is_empty());
    opts.check = !a.no_check;
    opts.pool_prefix = a.pool_prefix;
    opts.iface_prefix = a.iface_prefix;
    opts.verbose = a.verbose;
    opts.tls = a.tls;
    let out = stdout_out();
    // One signal stream for the whole run, so a Ctrl-C between start-up and serving is
    // not lost.
    let mut signals = Signals::new()?;
    let up = Up::start(opts, out.clone(), signals.next()).await?;
    out(&up.banner());
    up.serve(signals.next()).await?;
    out("stopped");
    Ok(())
}

/// `agentenv certs`: prints each file written.
fn certs(cmd: CertsCmd) -> anyhow::Result<()> {
    use agentenv_bin::pki::{Pki, Request, Role};
    match cmd {
        CertsCmd::Ca { dir } => {
            let pki = Pki::init(&dir)?;
            println!(
                "wrote {} (the CA: copy it to every host and client)",
                pki.ca.display()
            );
            println!(
                "wrote {} (the CA's key: keep it here, readable by root only)",
                dir.join("ca-key.pem").display()
            );
            println!(
                "next: agentenv certs issue --dir {} --name <host> --ip <its address>",
                dir.display()
            );
        }
        CertsCmd::Issue {
            dir,
            name,
            ips,
            dns,
            client,
            days,
            force,
        } => {
            let pki = Pki::open(&dir)?;
            let id = pki.issue(&Request {
                name: &name,
                ips: &ips,
                dns: &dns,
                role: if client { Role::Client } else { Role::Peer },
                days,
                force,
            })?;
            println!("wrote {}", id.cert.display());
            println!("wrote {} (mode 0600)", id.key.display());
        }
    }
    Ok(())
}

/// SIGINT and SIGTERM, listened to from the start.
struct Signals {
    int: Signal,
    term: Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
        })
    }

    /// Resolves at the next SIGINT or SIGTERM.
    async fn next(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}
