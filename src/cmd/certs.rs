//! `tokenlog certs`: a CA and the certificates of a cluster's processes, for tests, compose and
//! first deployments. Each certificate names its holder's role in OU and its name in CN (what the
//! log's role checks read, `tokenlog_raftlog::tls`); node certificates also carry the DNS name
//! every client verifies (`tokenlog-node`).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tokenlog_raftlog::tls::{Role, DECODER_SERVER_NAME, NODE_SERVER_NAME, POOL_SUFFIX};

#[derive(clap::Args)]
#[command(after_help = "\
Files: OUT/ca.pem and OUT/ca.key (the CA; kept and reused when they exist, so a later run adds \
certificates under the same CA), and OUT/NAME.pem, OUT/NAME.key for each holder. Keys are \
written readable by their owner only.\n\n\
Example (3 nodes on three machines):\n  \
tokenlog certs --out certs --node node-1 --node node-2 --node node-3 --decoder gpu-1 \
--gateway gw-1 --admin ops --san 10.0.0.1,10.0.0.2,10.0.0.3\n\n\
A decoder certificate is bound to its name: the log takes from its holder only that decoder id \
(`tokenlog decoder --decoder-id`, default the certificate's name) and stage id. Decoders that \
share one certificate use a pool's (--decoder-pool PREFIX: ids PREFIX-anything).\n\n\
With no holder named, makes node-1..node-3, decoder-1, decoder-2, gateway-1, gateway-2 and admin.")]
pub struct CertsArgs {
    /// Directory to write to (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Log nodes to certify (role node; may be repeated or comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub node: Vec<String>,
    /// Decoders to certify (role decoder). The log takes from each only the decoder id (and
    /// stage id) its certificate names.
    #[arg(long, value_delimiter = ',')]
    pub decoder: Vec<String>,
    /// Decoder pools to certify: one certificate (files PREFIX.pem, PREFIX.key; its name
    /// PREFIX-*) that several decoders share, each under an id of its own that starts with
    /// PREFIX- (a Kubernetes Deployment's pods named PREFIX-...).
    #[arg(long, value_delimiter = ',')]
    pub decoder_pool: Vec<String>,
    /// Gateways to certify (role gateway).
    #[arg(long, value_delimiter = ',')]
    pub gateway: Vec<String>,
    /// Operators to certify (role admin: membership, verify, status).
    #[arg(long, value_delimiter = ',')]
    pub admin: Vec<String>,
    /// More names (DNS names or IP addresses) for every node, decoder and gateway certificate,
    /// besides its own name, tokenlog-node (nodes) or tokenlog-decoder (decoders: their handoff
    /// listeners), localhost and 127.0.0.1.
    #[arg(long, value_delimiter = ',')]
    pub san: Vec<String>,
    /// Days the certificates stay valid.
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub days: u32,
    /// Overwrite a holder's existing certificate and key (to renew or rotate them).
    #[arg(long)]
    pub force: bool,
}

fn write_private(path: &Path, pem: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    // `mode` applies to a file it creates: one being overwritten (--force) keeps its
    // permissions, which may let others read the new key. Set before the key goes in.
    use std::os::unix::fs::PermissionsExt;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} readable by its owner only", path.display()))?;
    f.write_all(pem.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn validity(params: &mut CertificateParams, days: u32) {
    let now = time::OffsetDateTime::now_utc();
    // An hour of slack for clocks that are a little behind the one that made the certificate.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(days as i64);
}

/// The CA in `out`: read when both files exist, made otherwise.
fn ca(out: &Path, days: u32) -> anyhow::Result<Issuer<'static, KeyPair>> {
    let (cert, key) = (out.join("ca.pem"), out.join("ca.key"));
    match (cert.exists(), key.exists()) {
        (true, true) => {
            let key_pem = std::fs::read_to_string(&key).with_context(|| format!("reading {}", key.display()))?;
            let cert_pem = std::fs::read_to_string(&cert).with_context(|| format!("reading {}", cert.display()))?;
            let key = KeyPair::from_pem(&key_pem).with_context(|| format!("{}: not a private key", key.display()))?;
            eprintln!("using the CA in {}", cert.display());
            Issuer::from_ca_cert_pem(&cert_pem, key)
                .with_context(|| format!("{}: not a CA certificate", cert.display()))
        }
        (false, false) => {
            let mut params = CertificateParams::default();
            params.distinguished_name = DistinguishedName::new();
            // A name of its own, so that two clusters' CAs are told apart in messages.
            let tag: u32 = rand::random();
            params
                .distinguished_name
                .push(DnType::CommonName, format!("tokenlog cluster CA {tag:08x}"));
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            validity(&mut params, days.max(3650));
            let key = KeyPair::generate()?;
            let c = params.self_signed(&key)?;
            std::fs::write(&cert, c.pem()).with_context(|| format!("writing {}", cert.display()))?;
            write_private(&key_path(out, "ca"), &key.serialize_pem())?;
            eprintln!("made a CA: {}", cert.display());
            Ok(Issuer::new(params, key))
        }
        _ => bail!(
            "{} holds one of ca.pem and ca.key but not the other; restore the missing one or move both aside",
            out.display()
        ),
    }
}

fn key_path(out: &Path, name: &str) -> PathBuf {
    out.join(format!("{name}.key"))
}

fn san(name: &str) -> anyhow::Result<SanType> {
    Ok(match name.parse::<IpAddr>() {
        Ok(ip) => SanType::IpAddress(ip),
        Err(_) if is_dns_name(name) => SanType::DnsName(
            name.try_into()
                .with_context(|| format!("{name:?} is neither an IP address nor a DNS name"))?,
        ),
        // rcgen takes any ASCII text as a DNS name: "10.0.0.1 10.0.0.2" or "" went into the
        // certificate, and TLS failed later with an error that did not lead back here.
        Err(_) => bail!(
            "{name:?} is neither an IP address nor a DNS name (letters, digits and '-' in dot-separated labels; a list is comma-separated)"
        ),
    })
}

/// Whether `name` is a DNS name a certificate may carry: dot-separated labels of letters,
/// digits and '-' (not at either end), each of 1 to 63 bytes, 253 in all; a leading `*.` for
/// a wildcard.
fn is_dns_name(name: &str) -> bool {
    let rest = name.strip_prefix("*.").unwrap_or(name);
    !rest.is_empty()
        && name.len() <= 253
        && rest.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// The certificate of `name` in `role`, signed by `ca`, with its own key.
fn holder(
    ca: &Issuer<'_, KeyPair>,
    role: Role,
    name: &str,
    extra_sans: &[String],
    days: u32,
) -> anyhow::Result<(String, String)> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params
        .distinguished_name
        .push(DnType::OrganizationalUnitName, role.as_str());
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    // A pool's name (`PREFIX-*`) is no DNS name: the certificate carries its prefix.
    let mut names: Vec<String> = vec![name.strip_suffix(POOL_SUFFIX).unwrap_or(name).to_string()];
    if matches!(role, Role::Node | Role::Gateway | Role::Decoder) {
        // All three serve: a node to peers and clients, a gateway to its clients, a decoder
        // planned handoffs to other decoders.
        params.extended_key_usages.push(ExtendedKeyUsagePurpose::ServerAuth);
        match role {
            Role::Node => names.push(NODE_SERVER_NAME.into()),
            Role::Decoder => names.push(DECODER_SERVER_NAME.into()),
            _ => {}
        }
        names.extend(["localhost".to_string(), "127.0.0.1".to_string()]);
        names.extend(extra_sans.iter().cloned());
    }
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    params.subject_alt_names = names.iter().map(|n| san(n)).collect::<anyhow::Result<_>>()?;
    validity(&mut params, days);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, ca)?;
    Ok((cert.pem(), key.serialize_pem()))
}

pub fn run(a: CertsArgs) -> anyhow::Result<()> {
    let mut holders: Vec<(Role, String)> = Vec::new();
    for (role, names) in [
        (Role::Node, &a.node),
        (Role::Decoder, &a.decoder),
        (Role::Decoder, &a.decoder_pool),
        (Role::Gateway, &a.gateway),
        (Role::Admin, &a.admin),
    ] {
        holders.extend(names.iter().map(|n| (role, n.clone())));
    }
    let pools: std::collections::HashSet<&str> = a.decoder_pool.iter().map(String::as_str).collect();
    if holders.is_empty() {
        holders = vec![
            (Role::Node, "node-1".into()),
            (Role::Node, "node-2".into()),
            (Role::Node, "node-3".into()),
            (Role::Decoder, "decoder-1".into()),
            (Role::Decoder, "decoder-2".into()),
            (Role::Gateway, "gateway-1".into()),
            (Role::Gateway, "gateway-2".into()),
            (Role::Admin, "admin".into()),
        ];
    }
    for (i, (_, name)) in holders.iter().enumerate() {
        // The name goes into the certificate's names (a DNS name): checked by that rule here,
        // before anything is written. '_' passed this check, the CA and the holders before it
        // were written, and then the certificate was refused with a message about --san.
        if name == "ca" || !is_dns_name(name) {
            bail!(
                "{name:?} cannot name a certificate holder: use letters, digits and '-' in dot-separated labels (it is the certificate's DNS name), and not \"ca\""
            );
        }
        if holders[..i].iter().any(|(_, n)| n == name) {
            bail!("{name:?} is named twice");
        }
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let ca = ca(&a.out, a.days)?;
    for (role, name) in &holders {
        let (cert_path, key_path) = (a.out.join(format!("{name}.pem")), key_path(&a.out, name));
        if !a.force && (cert_path.exists() || key_path.exists()) {
            eprintln!("kept {} (exists; --force makes a new one)", cert_path.display());
            continue;
        }
        let cn = if pools.contains(name.as_str()) {
            format!("{name}{POOL_SUFFIX}")
        } else {
            name.clone()
        };
        let (cert, key) = holder(&ca, *role, &cn, &a.san, a.days)?;
        write_private(&key_path, &key)?;
        std::fs::write(&cert_path, cert).with_context(|| format!("writing {}", cert_path.display()))?;
        say!("{role:<8} {cn}: {} {}", cert_path.display(), key_path.display());
    }
    Ok(())
}
