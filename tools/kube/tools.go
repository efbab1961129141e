//go:build tools

// Package tools pins the Kubernetes API server and etcd the deploy
// package's tests run (scripts/install-test-tools.sh builds them):
// kube-apiserver from k8s.io/kubernetes, whose staging modules are pinned
// to the same release by the replace directives, and etcd's server at the
// version that release names.
package tools

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
