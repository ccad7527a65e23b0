//! `tokenlog keys`: API keys for a gateway's keys file (`--keys`). The file holds only the
//! keys' SHA-256 hashes, so a copy of it lets nobody in.

use tokenlog_gateway::tenants::keys_file_line;

#[derive(clap::Subcommand)]
pub enum KeysCmd {
    /// Make a new random key for a tenant: prints the key (give it to the tenant; it is not
    /// stored anywhere) and the line to append to the keys file.
    New {
        /// The tenant the key belongs to.
        #[arg(long)]
        tenant: String,
    },
    /// Print the keys-file line of an existing key (read from standard input, one line, so it
    /// stays out of the shell history).
    Hash {
        /// The tenant the key belongs to.
        #[arg(long)]
        tenant: String,
    },
}

pub fn run(cmd: KeysCmd) -> anyhow::Result<()> {
    let check = |t: &str| {
        anyhow::ensure!(
            !t.is_empty() && !t.contains(char::is_whitespace) && !t.contains('#'),
            "a tenant name is one word without '#'"
        );
        anyhow::ensure!(
            t.len() <= tokenlog_raftlog::limits::TENANT_BYTES_MAX,
            "a tenant name has at most {} bytes",
            tokenlog_raftlog::limits::TENANT_BYTES_MAX
        );
        Ok(())
    };
    match cmd {
        KeysCmd::New { tenant } => {
            check(&tenant)?;
            let key = format!("tlk_{}", hex(&rand::random::<[u8; 24]>()));
            say!("key:  {key}");
            say!("line: {}", keys_file_line(&key, &tenant));
            eprintln!("append the line to the gateway's keys file; give the key to tenant {tenant:?}");
        }
        KeysCmd::Hash { tenant } => {
            check(&tenant)?;
            let mut key = String::new();
            std::io::stdin().read_line(&mut key)?;
            let key = key.trim();
            anyhow::ensure!(!key.is_empty(), "no key on standard input");
            // Clients send keys in a header, which carries visible ASCII only: another key
            // could be hashed but never sent.
            anyhow::ensure!(
                key.chars().all(|c| c.is_ascii_graphic()),
                "a key is visible ASCII without spaces (it travels in an HTTP header); this one is not"
            );
            say!("{}", keys_file_line(key, &tenant));
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
