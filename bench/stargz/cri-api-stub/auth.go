// Package v1alpha2 stands in for k8s.io/cri-api/pkg/apis/runtime/v1alpha2,
// which Debian does not package. stargz-snapshotter's resolver package needs
// only its AuthConfig type (to convert the CRI plugin's registry auth); the
// benchmark's daemon never receives CRI credentials, so the plain struct,
// with the fields of the CRI message of that name, is all it takes.
// bench/stargz.py places this file at that import path in the build's GOPATH.
package v1alpha2

// AuthConfig holds the registry credentials of a CRI PullImageRequest.
type AuthConfig struct {
	Username      string
	Password      string
	Auth          string
	ServerAddress string
	IdentityToken string
	RegistryToken string
}
