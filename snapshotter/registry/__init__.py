"""The registry client every bootseer part shares: references, hosts.toml,
docker credentials, manifests, blobs, ranges and OCI referrers.

Import what you need from its modules (`client.RegistryClient`,
`errors.RegistryError`, `reference.parse`, `media.Descriptor`, ...): this
package file stays empty so that reading the `[registry]` config section
(`settings.py`) does not load the HTTP stack.
"""
