module pagoda.local/e2e/tools/etcd

go 1.25

require go.etcd.io/etcd/server/v3 v3.6.16
