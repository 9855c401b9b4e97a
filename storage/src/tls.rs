//! The crypto provider behind S3 clients' TLS: ring. reqwest is built without a provider of its
//! own (aws-lc's C build cost more than the rest of the S3 client), so one is installed as
//! rustls's process default before a client is built.

/// Installs ring as rustls's process-wide default provider, unless the program installed one
/// first (that one then serves). Called before every S3 client is built; cheap after the first.
pub fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // An Err means another thread installed one in between: that one serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use object_store::ObjectStoreExt;

    /// A client for an https endpoint opens with a TLS ClientHello: the provider is in place
    /// (without one, building the client would panic).
    #[tokio::test]
    async fn s3_clients_speak_tls() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut head = [0u8; 6];
            conn.read_exact(&mut head).unwrap();
            head
        });
        super::install_crypto_provider();
        let store = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name("bucket")
            .with_endpoint(format!("https://{addr}"))
            .with_region("us-east-1")
            .with_access_key_id("key")
            .with_secret_access_key("secret")
            .with_retry(object_store::RetryConfig { max_retries: 0, ..Default::default() })
            .build()
            .unwrap();
        // The server hangs up after the hello: the request fails once the hello is sent.
        assert!(store.head(&"x".into()).await.is_err());
        if !server.is_finished() {
            // No connection came: unblock the server with a byte string that fails below.
            std::net::TcpStream::connect(addr).unwrap().write_all(&[0; 6]).unwrap();
        }
        let head = server.join().unwrap();
        assert_eq!((head[0], head[5]), (0x16, 0x01), "a TLS handshake record holding a ClientHello: {head:?}");
    }
}
