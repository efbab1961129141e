// Package deploy holds no code: its tests check what deploy/ ships to run
// sloserve on Kubernetes (the Helm chart, the KServe serving runtime, the
// KEDA and HPA autoscaling examples). They render the chart with the helm
// that `make test-tools` installs and decode every object strictly into the
// Kubernetes API types (k8s.io/api) or, for custom resources, into the
// fields of their CRDs the manifests use, then check that the pieces agree
// with each other and with the server (ports, health paths, shutdown timing,
// the recording rules the autoscalers query).
//
// No API server runs here: the tests prove the objects are well formed and
// consistent, not that a cluster accepts and runs them.
package deploy
