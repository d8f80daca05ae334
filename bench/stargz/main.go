// Command bench-stargz-grpc is the benchmark's build of stargz-snapshotter's
// remote snapshotter daemon (the role of upstream's containerd-stargz-grpc),
// which Debian does not package: Debian ships the library
// (golang-github-containerd-stargz-snapshotter-dev), so this small main wires
// its public packages into a containerd proxy snapshotter, with the library's
// defaults. bench/stargz.py builds it in GOPATH mode over /usr/share/gocode.
//
// It serves containerd's Snapshots API on --address; containerd reaches it
// through a [proxy_plugins.stargz] stanza, and `ctr-remote image rpull` adds
// the labels its remote layers need.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/contrib/snapshotservice"
	"github.com/containerd/containerd/log"
	"github.com/containerd/stargz-snapshotter/service"
	"github.com/containerd/stargz-snapshotter/service/keychain/dockerconfig"
	"github.com/BurntSushi/toml"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
)

func main() {
	address := flag.String("address", "/run/containerd-stargz-grpc/containerd-stargz-grpc.sock", "unix socket to serve the Snapshots API on")
	root := flag.String("root", "/var/lib/containerd-stargz-grpc", "state directory (snapshots, layer cache, FUSE mounts)")
	configPath := flag.String("config", "", "optional TOML file in stargz-snapshotter's config format; empty means the library defaults")
	logLevel := flag.String("log-level", "info", "logrus level")
	flag.Parse()

	level, err := logrus.ParseLevel(*logLevel)
	if err != nil {
		fmt.Fprintf(os.Stderr, "bad --log-level: %v\n", err)
		os.Exit(2)
	}
	logrus.SetLevel(level)
	logrus.SetFormatter(&logrus.TextFormatter{FullTimestamp: true})
	ctx, cancel := context.WithCancel(log.WithLogger(context.Background(), log.L))
	defer cancel()

	// The zero Config is what "defaults" means here: NewFilesystem fills in
	// every unset field (prefetch on, background fetch on, memory metadata).
	var cfg service.Config
	if *configPath != "" {
		if _, err := toml.DecodeFile(*configPath, &cfg); err != nil {
			log.G(ctx).WithError(err).Fatalf("cannot read %s", *configPath)
		}
	}

	if err := os.MkdirAll(*root, 0o700); err != nil {
		log.G(ctx).WithError(err).Fatalf("cannot create root %s", *root)
	}
	// Credentials from ~/.docker/config.json, as upstream's default keychain;
	// the CRI and kubeconfig keychains need a kubelet and are left out.
	sn, err := service.NewStargzSnapshotterService(ctx, *root, &cfg,
		service.WithCredsFuncs(dockerconfig.NewDockerconfigKeychain(ctx)))
	if err != nil {
		log.G(ctx).WithError(err).Fatal("cannot start the snapshotter")
	}

	if err := os.MkdirAll(filepath.Dir(*address), 0o700); err != nil {
		log.G(ctx).WithError(err).Fatalf("cannot create the socket's directory")
	}
	// A socket left by a killed predecessor would make Listen fail.
	if err := os.Remove(*address); err != nil && !os.IsNotExist(err) {
		log.G(ctx).WithError(err).Fatalf("cannot remove the stale socket %s", *address)
	}
	listener, err := net.Listen("unix", *address)
	if err != nil {
		log.G(ctx).WithError(err).Fatalf("cannot listen on %s", *address)
	}
	server := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(server, snapshotservice.FromSnapshotter(sn))

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()
	log.G(ctx).Infof("serving on %s, root %s", *address, *root)

	select {
	case sig := <-signals:
		log.G(ctx).Infof("%v: stopping", sig)
	case err := <-served:
		log.G(ctx).WithError(err).Error("server stopped")
	}
	server.Stop()
	// Close unmounts nothing by itself: the caller (bench/stargz.py) unmounts
	// what is left under the root, as a node's shutdown would.
	if err := sn.Close(); err != nil {
		log.G(ctx).WithError(err).Error("closing the snapshotter")
	}
}
