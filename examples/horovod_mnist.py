"""An MNIST-style convolutional classifier trained with Horovod's API on mpicomm, on synthetic
digits (random 28x28 images whose label decides a bright patch: learnable, no download).

    mpiexec -n 2 python -m mpi4py examples/horovod_mnist.py [--epochs 2] [--fp16-allreduce]

A Horovod script: ``import mpicomm.horovod as hvd`` is the one line changed.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import mpicomm.horovod as hvd


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 5)
        self.conv2 = torch.nn.Conv2d(8, 16, 5)
        self.fc1 = torch.nn.Linear(256, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def synthetic_digits(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = 0.3 * torch.randn(n, 1, 28, 28, generator=g)
    for i, y in enumerate(labels.tolist()):
        r, c = divmod(y, 5)
        images[i, 0, 4 + 10 * r:10 + 10 * r, 2 + 5 * c:6 + 5 * c] += 2.0
    return torch.utils.data.TensorDataset(images, labels)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set = synthetic_digits(args.samples, seed=1)
    test_set = synthetic_digits(args.samples // 4, seed=2)
    # each rank reads its own part of the data
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.batch_size,
                                              sampler=test_sampler)

    model = Net()
    # the learning rate scales with the number of ranks (the global batch grows with it)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: last batch loss {loss.item():.4f}", flush=True)

    model.eval()
    test_loss = correct = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            out = model(data)
            test_loss += F.nll_loss(out, target, reduction="sum").item()
            correct += out.argmax(1).eq(target).sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
    # every rank holds the same weights: DistributedOptimizer applied the same averaged gradients
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    same = all(torch.equal(flat, other) for other in hvd.allgather_object(flat))
    if hvd.rank() == 0:
        print(f"test set: average loss {test_loss:.4f}, accuracy {100 * accuracy:.1f}%, "
              f"weights equal on all {hvd.size()} ranks: {same}", flush=True)
    if not same:
        raise SystemExit("the ranks' weights differ")
    return {"loss": test_loss, "accuracy": accuracy}


if __name__ == "__main__":
    main()
